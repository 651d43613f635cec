"""The engine's request loop: accept, prefill, decode, stop, account. No transport code.

    submit() --validate--> Started ──> waiting deque ──> loop thread: prefill, decode ... ──> Finished
                                                           each step: sample, detokenize, stop checks

Requests run one at a time on the loop thread, which owns the model runner (and so the device).
Every accepted request ends with exactly one Finished event, whatever happens.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from services.engine.sampling import Sampler, SamplingConfig

log = logging.getLogger("strata.engine")
serve_log = logging.getLogger("strata.serve")


class InvalidRequest(ValueError):
    """The request cannot be served as asked (the client must change it)."""


class PromptTooLong(InvalidRequest):
    def __init__(self, prompt_tokens: int, context_window: int):
        super().__init__(
            f"prompt is {prompt_tokens} tokens but the model's context window is "
            f"{context_window} tokens; shorten the prompt by at least "
            f"{prompt_tokens - context_window + 1} tokens")
        self.prompt_tokens = prompt_tokens
        self.context_window = context_window


@dataclass(frozen=True)
class GenerateParams:
    max_tokens: int = 0  # 0: up to the context window
    stop: tuple[str, ...] = ()
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    logprobs: bool = False  # report the sampled token's log-probability
    top_logprobs: int = 0  # and this many most likely alternatives


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    params: GenerateParams
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content), chat-templated
    prompt: str | None = None  # raw completion prompt


@dataclass(frozen=True)
class RequestStats:
    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    ttft_ms: float = 0.0
    decode_tok_s: float = 0.0
    # Decode-phase expert cache figures (see services/engine/cache/stats.py).
    lookups: int = 0
    hits: int = 0
    spilled: int = 0
    misses_host: int = 0  # missed tokens computed on the host
    misses_copied: int = 0  # missed tokens whose expert was copied over the link first
    prefetch_predicted: int = 0  # distinct pairs predicted for the next layer
    prefetch_predicted_routed: int = 0  # ... that the layer then routed to
    prefetch_routed: int = 0  # distinct pairs routed in layers that had a prediction
    prefill_lookups: int = 0
    prefill_hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    @property
    def spill_ratio(self) -> float:
        return self.spilled / self.lookups if self.lookups else 0.0

    @property
    def prefetch_precision(self) -> float:
        p = self.prefetch_predicted
        return self.prefetch_predicted_routed / p if p else 0.0

    @property
    def prefetch_recall(self) -> float:
        r = self.prefetch_routed
        return self.prefetch_predicted_routed / r if r else 0.0


@dataclass(frozen=True)
class Started:
    prompt_tokens: int
    context_window: int


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float
    token_bytes: bytes


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    token_bytes: bytes
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class Delta:
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" | "length" | "abort"
    stats: RequestStats
    error: str = ""


Event = Started | Delta | Finished
Sink = Callable[[Event], None]


class Runner(Protocol):
    """What the loop needs from services.engine.runner.ModelRunner."""

    tokenizer: object
    config: object

    def start(self, prompt_ids: list[int]) -> object: ...
    def prefill(self, seq: object) -> object: ...
    def decode(self, seq: object, token_id: int) -> object: ...
    def release(self, seq: object) -> None: ...


@dataclass
class RequestHandle:
    request: EngineRequest
    prompt_ids: list[int]
    sink: Sink
    submitted_at: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass
class EngineTotals:
    """Lifetime figures, written by the loop thread only."""

    requests_finished: int = 0
    tokens_generated: int = 0
    lookups: int = 0
    hits: int = 0
    spilled: int = 0


class Engine:
    def __init__(self, runner: Runner):
        self.runner = runner
        self.context_window: int = runner.config.context_window  # type: ignore[attr-defined]
        self.totals = EngineTotals()
        self._waiting: collections.deque[RequestHandle] = collections.deque()
        self._between_steps: collections.deque[Callable[[], None]] = collections.deque()
        self._wakeup = threading.Condition()
        self._running = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="strata-engine-loop", daemon=True)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Finish the running request, abort the waiting ones, stop the loop thread."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify_all()
        self._thread.join(timeout_s)
        while self._waiting:
            handle = self._waiting.popleft()
            handle.sink(Finished("abort", RequestStats(prompt_tokens=len(handle.prompt_ids)),
                                 "engine shutting down"))

    def call_between_steps(self, fn: Callable[[], None]) -> None:
        """Run fn on the loop thread, which owns the runner, before the next step (a new plan's
        cache fill, say); exceptions are logged, not raised."""
        with self._wakeup:
            self._between_steps.append(fn)
            self._wakeup.notify()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return self._running

    # -- requests ----------------------------------------------------------------------------
    def submit(self, request: EngineRequest, sink: Sink) -> RequestHandle:
        """Tokenize and validate; raises InvalidRequest before any event, else emits Started."""
        prompt_ids = self._tokenize(request)
        if len(prompt_ids) >= self.context_window:
            raise PromptTooLong(len(prompt_ids), self.context_window)
        if self._stopping:
            raise RuntimeError("engine is shutting down")
        handle = RequestHandle(request, prompt_ids, sink)
        sink(Started(len(prompt_ids), self.context_window))
        with self._wakeup:
            self._waiting.append(handle)
            self._wakeup.notify()
        return handle

    def _tokenize(self, request: EngineRequest) -> list[int]:
        tokenizer = self.runner.tokenizer
        if request.messages is not None:
            if not request.messages:
                raise InvalidRequest("messages must not be empty")
            try:
                text = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
                    [{"role": r, "content": c} for r, c in request.messages],
                    add_generation_prompt=True)
            except ValueError as exc:  # the template rejected the conversation
                raise InvalidRequest(str(exc)) from exc
        else:
            text = request.prompt or ""
        ids = tokenizer.encode(text)  # type: ignore[attr-defined]
        if not ids:
            raise InvalidRequest("prompt is empty")
        return list(ids)

    # -- loop thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wakeup:
                while not self._waiting and not self._between_steps and not self._stopping:
                    self._wakeup.wait()
                if self._stopping:
                    return
                chores = list(self._between_steps)
                self._between_steps.clear()
                handle = self._waiting.popleft() if self._waiting else None
                self._running = int(handle is not None)
            for chore in chores:
                try:
                    chore()
                except Exception:
                    log.exception("work between engine steps failed; the engine keeps serving")
            if handle is None:
                continue
            try:
                finished = self._serve(handle)
            except Exception as exc:  # the loop must outlive any one request
                log.exception("request %s failed inside the engine: %s",
                              handle.request.request_id, exc)
                finished = Finished("abort", RequestStats(prompt_tokens=len(handle.prompt_ids)),
                                    f"engine error: {type(exc).__name__}: {exc}")
            finally:
                self._running = 0
            self._account(finished.stats)
            handle.sink(finished)

    def _serve(self, handle: RequestHandle) -> Finished:
        started = time.perf_counter()
        queue_ms = (started - handle.submitted_at) * 1e3
        prompt_len = len(handle.prompt_ids)
        if handle.cancelled.is_set():
            return Finished("abort", RequestStats(prompt_tokens=prompt_len, queue_ms=queue_ms),
                            "cancelled before it started")
        runner = self.runner
        seq = runner.start(handle.prompt_ids)
        try:
            logits = runner.prefill(seq)
            prefill_done = time.perf_counter()
            reason, num_generated, first_token_at = self._decode(handle, seq, logits)
            decode_done = time.perf_counter()
        finally:
            runner.release(seq)
        routing = seq.stats  # type: ignore[attr-defined]
        decode_s = decode_done - prefill_done
        stats = RequestStats(
            prompt_tokens=prompt_len,
            completion_tokens=num_generated,
            queue_ms=queue_ms,
            prefill_ms=(prefill_done - started) * 1e3,
            decode_ms=decode_s * 1e3,
            ttft_ms=((first_token_at or decode_done) - handle.submitted_at) * 1e3,
            decode_tok_s=num_generated / decode_s if decode_s > 0 and num_generated else 0.0,
            **_cache_figures(routing))
        self._log_request(stats)
        error = "cancelled by the client" if reason == "abort" else ""
        return Finished(reason, stats, error)

    def _decode(self, handle: RequestHandle, seq: object, logits: object
                ) -> tuple[str, int, float | None]:
        """Sample until EOS, a stop string, max_tokens or the window; returns (reason, n, t_first)."""
        runner, params = self.runner, handle.request.params
        sampler = Sampler(params.sampling)
        eos_ids = runner.tokenizer.eos_token_ids  # type: ignore[attr-defined]
        room = self.context_window - len(handle.prompt_ids)
        max_new = min(params.max_tokens, room) if params.max_tokens > 0 else room
        text = _TextStream(runner.tokenizer, params.stop)
        first_token_at: float | None = None
        generated = 0
        while True:
            if handle.cancelled.is_set():
                return "abort", generated, first_token_at
            token_id = sampler.sample(logits)
            if first_token_at is None:
                first_token_at = time.perf_counter()
            if token_id in eos_ids:
                self._emit(handle, text.flush(), ())
                return "stop", generated, first_token_at
            generated += 1
            new_text, hit_stop = text.push(token_id)
            logprobs = (self._logprobs(logits, token_id, params.top_logprobs),
                        ) if params.logprobs else ()
            self._emit(handle, new_text, (token_id,), logprobs)
            if hit_stop:
                return "stop", generated, first_token_at
            if generated >= max_new:
                self._emit(handle, text.flush(), ())
                return "length", generated, first_token_at
            logits = runner.decode(seq, token_id)

    @staticmethod
    def _emit(handle: RequestHandle, text: str, token_ids: tuple[int, ...],
              logprobs: tuple[TokenLogprob, ...] = ()) -> None:
        if text or token_ids:
            handle.sink(Delta(text, token_ids, logprobs))

    def _logprobs(self, logits: torch.Tensor, token_id: int, num_top: int) -> TokenLogprob:
        """Log-probabilities under the model's distribution (before temperature/top-p)."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # [V]
        tokenizer = self.runner.tokenizer

        def describe(tid: int) -> tuple[str, bytes]:
            raw = tokenizer.token_bytes(tid)  # type: ignore[attr-defined]
            return raw.decode("utf-8", errors="backslashreplace"), raw

        top = []
        if num_top:
            values, ids = torch.topk(logprobs, num_top)
            for value, tid in zip(values.tolist(), ids.tolist(), strict=True):
                top_token, top_raw = describe(tid)
                top.append(TopLogprob(tid, top_token, value, top_raw))
        token, raw = describe(token_id)
        return TokenLogprob(token_id, token, float(logprobs[token_id]), raw, tuple(top))

    def _account(self, stats: RequestStats) -> None:
        totals = self.totals
        totals.requests_finished += 1
        totals.tokens_generated += stats.completion_tokens
        totals.lookups += stats.lookups
        totals.hits += stats.hits
        totals.spilled += stats.spilled

    @staticmethod
    def _log_request(s: RequestStats) -> None:
        # The two per-request lines of design.md section 1, paired in order by `strata bench dataset`.
        serve_log.info(
            "strata serve: prompt %d tokens = %d reused + %d read in %.0f ms, "
            "%d generated in %.0f ms (%.1f tok/s)",
            s.prompt_tokens, s.reused_prompt_tokens, s.prompt_tokens - s.reused_prompt_tokens,
            s.prefill_ms, s.completion_tokens, s.decode_ms, s.decode_tok_s)
        serve_log.info(
            "strata serve: decode expert cache hit rate: %.1f%% (%d hits / %d lookups); "
            "%d more served from host RAM (%.2f%% of all %d routed); "
            "misses by placement: %d host-computed, %d copied over the link%s",
            100 * s.hit_rate, s.hits, s.lookups, s.spilled, 100 * s.spill_ratio, s.lookups,
            s.misses_host, s.misses_copied,
            f"; prefetch precision {100 * s.prefetch_precision:.1f}% recall "
            f"{100 * s.prefetch_recall:.1f}%" if s.prefetch_predicted else "")


def _cache_figures(routing: object) -> dict[str, int]:
    """RequestStats' cache fields from a runner Sequence's RoutingStats."""
    d, p = routing.decode, routing.prefill  # type: ignore[attr-defined]
    return dict(lookups=d.lookups, hits=d.hits, spilled=d.spilled, misses_host=d.misses_host,
                misses_copied=d.misses_copied, prefetch_predicted=d.predicted,
                prefetch_predicted_routed=d.predicted_routed,
                prefetch_routed=d.routed_with_prediction, prefill_lookups=p.lookups,
                prefill_hits=p.hits)


class _TextStream:
    """Incremental detokenizer with stop strings.

    Holds back text that may still change: an incomplete UTF-8 sequence (decodes to U+FFFD)
    and any tail that could be the start of a stop string.
    """

    def __init__(self, tokenizer: object, stop: tuple[str, ...]):
        self._tokenizer = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._ids: list[int] = []
        self._text = ""
        self._emitted = 0  # chars of _text already sent

    def push(self, token_id: int) -> tuple[str, bool]:
        """Returns (text now safe to send, whether a stop string ended the output)."""
        self._ids.append(token_id)
        self._text = self._tokenizer.decode(self._ids)  # type: ignore[attr-defined]
        for stop in self._stop:
            found = self._text.find(stop, max(0, self._emitted - len(stop) + 1))
            if found != -1:
                out = self._text[self._emitted:found]
                self._emitted = len(self._text)
                return out, True
        safe = len(self._text.rstrip("\ufffd"))
        safe -= self._stop_prefix_len(self._text[:safe])
        out = self._text[self._emitted:max(safe, self._emitted)]
        self._emitted = max(safe, self._emitted)
        return out, False

    def flush(self) -> str:
        out = self._text[self._emitted:]
        self._emitted = len(self._text)
        return out

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
