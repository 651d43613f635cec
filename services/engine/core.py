"""The engine's request loop: accept, schedule, step, sample, stop, account. No transport code.

    submit() --validate--> Started ──> intake ──> loop thread, once per step:
        scheduler.schedule()  decode tokens of running sequences + prefill chunks + admissions
        runner.step()         one forward pass over all of them (one shared expert cache)
        per sampled chunk:    sample, detokenize, stop checks ──> one Delta per request
                              (all the tokens of its step) ... ──> Finished

With speculation on (`spec_tokens` > 0) every decoding sequence first gets up to k drafts from
the draft source; its decode chunk verifies them in the same forward, and the accepted ones
plus one more token go through the same per-token stop checks (services/engine/spec/).

The loop thread owns the model runner (and so the device). Every accepted request ends with
exactly one Finished event, whatever happens: EOS, stop string, length, cancellation (blocks freed
within one step), an engine error in its own chunk, or shutdown.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch

from services.common.counters import CacheCounters, PhaseCounters
from services.common.settings import available_cores
from services.common.tool_calls import (
    ARGUMENTS_AS_OBJECT,
    CHANNELED,
    KEEPS_SPECIAL,
    TOOL_CALL_MARKERS,
    TOOL_CALL_SYNTAXES,
)
from services.engine import kernels
from services.engine.block_manager import BlockManager
from services.engine.detokenize import TextStream
from services.engine.driver import chunk_work
from services.engine.grammar import (
    JSON_KINDS,
    GrammarError,
    Grammars,
    Guide,
    OutputConstraint,
    final_answer_constraint,
    tool_call_constraint,
)
from services.engine.requests import (
    ChatTurn,
    Delta,
    Echo,
    EngineRequest,
    EngineTotals,
    Finished,
    InvalidRequest,
    PromptTooLong,
    RequestHandle,
    RequestStats,
    Sink,
    Started,
    TokenizerInfo,
    TokenLogprob,
    ToolSpec,
    TopLogprob,
)
from services.engine.runner import ChunkWork
from services.engine.sampling import Sampler, argmax_ids, top_ids
from services.engine.scheduler import Chunk, Scheduler, SeqState, Step
from services.engine.spec.base import DraftRequest, DraftSource
from services.engine.spec.verify import accept_tokens
from services.engine.step_trace import StepTrace

log = logging.getLogger("strata.engine")
serve_log = logging.getLogger("strata.serve")

# A request scored at every prompt position (echo with logprobs) prefills in chunks whose fp32
# logits rows stay within this: 64 MiB is 110 rows of a 151936-token vocabulary.
SCORE_LOGITS_BYTES = 64 << 20
# What a chat template gets from Strata itself, never from chat_template_kwargs.
TEMPLATE_OWN_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token",
                                    "eos_token"})


class Runner(Protocol):
    """What the loop needs from services.engine.runner.ModelRunner."""

    tokenizer: Any
    config: Any
    kv: Any  # PagedKVCache: num_blocks, block_size, claim(), copy_blocks()
    step_logits: torch.Tensor | None  # the last step's logits rows, whose views step returned

    def step(self, chunks: Sequence[ChunkWork]) -> list[tuple[torch.Tensor | None,
                                                              CacheCounters]]: ...

    def release(self, seq_id: int) -> None: ...

    def rewind(self, seq_id: int, num_computed: int) -> None: ...


class _Live:
    """The loop thread's state of one accepted request (the scheduler's SeqState.payload)."""

    def __init__(self, handle: RequestHandle, tokenizer: Any, context_window: int,
                 guide: Guide | None = None):
        params = handle.request.params
        self.handle = handle
        eos = () if params.ignore_eos else tuple(tokenizer.eos_token_ids)
        self.end_ids = frozenset((*eos, *params.stop_token_ids))  # ids that end the sequence
        self.sampler = Sampler(params.sampling, handle.prompt_ids, self.end_ids, guide)
        # A chat answer in a syntax marked by special tokens keeps them (gpt-oss's channels
        # always, Kimi's and DeepSeek's call markers with tools): the gateway splits by them
        fmt, request = getattr(tokenizer, "tool_call_format", ""), handle.request
        tools = request.tools
        keep = request.messages is not None and (fmt in CHANNELED or (
            fmt in KEEPS_SPECIAL and tools is not None))
        # parallel_tool_calls false: the answer ends where its first call's block closes
        one_call = tools is not None and not tools.parallel and fmt in TOOL_CALL_MARKERS
        self.text = TextStream(tokenizer, params.stop, skip_special=not keep,
                               end_after=(TOOL_CALL_MARKERS[fmt][1],) if one_call else ())
        room = context_window - len(handle.prompt_ids)
        self.max_new = 0 if params.echo_only else \
            min(params.max_tokens, room) if params.max_tokens > 0 else room
        self.generated = 0
        self.cache = PhaseCounters()
        self.first_token_at: float | None = None
        self.drafts_proposed = self.drafts_accepted = self.verify_steps = 0
        self.rejected_lookups = self.draft_lookups = 0
        # This step's output so far, sent as one Delta when the step is done with the request.
        self.text_out: list[str] = []
        self.ids_out: list[int] = []
        self.logprobs_out: list[TokenLogprob] = []
        # echo: the prompt's Echo goes out with the first tokens; with logprobs, each prefill
        # chunk's rows score the prompt's next tokens into echo_logprobs first
        self.echo_due = params.echo
        self.echo_logprobs: list[TokenLogprob] | None = [] if params.echo and params.logprobs \
            else None

    @property
    def scoring(self) -> bool:
        """Its prompt's chunks still want every position's logits (echo with logprobs)."""
        return self.echo_logprobs is not None and self.echo_due

    def emit(self, text: str, token_id: int | None = None,
             logprob: TokenLogprob | None = None) -> None:
        if text:
            self.text_out.append(text)
        if token_id is not None:
            self.ids_out.append(token_id)
        if logprob is not None:
            self.logprobs_out.append(logprob)

    def flush(self) -> None:
        """Send this step's output, if any, as one Delta."""
        if self.text_out or self.ids_out:
            self.handle.sink(Delta("".join(self.text_out), tuple(self.ids_out),
                                   tuple(self.logprobs_out)))
            self.text_out, self.ids_out, self.logprobs_out = [], [], []

    def stats(self, seq: SeqState, finished_at: float) -> RequestStats:
        h = self.handle
        admitted = seq.admitted_at if seq.admitted_at is not None else finished_at
        first = self.first_token_at if self.first_token_at is not None else finished_at
        decode_s = finished_at - first
        guide = self.sampler.guide
        grammar = {} if guide is None else {
            "grammar_masks": guide.masks, "grammar_compute_ms": guide.compute_s * 1e3,
            "grammar_wait_ms": guide.wait_s * 1e3}
        return RequestStats(
            prompt_tokens=len(h.prompt_ids), reused_prompt_tokens=seq.num_reused,
            completion_tokens=self.generated,
            queue_ms=(admitted - h.submitted_at) * 1e3,
            prefill_ms=(first - admitted) * 1e3,
            decode_ms=decode_s * 1e3,
            ttft_ms=(first - h.submitted_at) * 1e3,
            # One token comes from the prefill alone: no decode rate to speak of.
            decode_tok_s=self.generated / decode_s if decode_s > 0 and self.generated > 1
            else 0.0,
            decode=self.cache.decode.copy(), prefill=self.cache.prefill.copy(),
            drafts_proposed=self.drafts_proposed,
            drafts_accepted=self.drafts_accepted, verify_steps=self.verify_steps,
            rejected_lookups=self.rejected_lookups, draft_lookups=self.draft_lookups, **grammar)


class Engine:
    """Continuous batching over one model runner: every step is one forward pass over the
    decode tokens of all running sequences plus chunks of pending prefills (see scheduler.py)."""

    def __init__(self, runner: Runner, *, max_running: int = 8, max_step_tokens: int = 512,
                 draft_source: DraftSource | None = None, spec_tokens: int = 0,
                 prefix_reuse: bool = True, gather_ms: float = 0.0,
                 step_trace: StepTrace | None = None):
        self.runner = runner
        self.step_trace = step_trace  # a line per step (--step-trace), or None
        # An idle engine's first step waits this long at most for the requests its first
        # arrivals say follow them (EngineRequest.following): a burst starts in one step.
        self.gather_s = gather_ms / 1e3
        self._step_s = self.gather_s  # recent steps' duration (moving average)
        # Speculative decoding: up to spec_tokens drafts per decoding sequence and step.
        self.draft_source = draft_source if spec_tokens > 0 else None
        self.spec_tokens = spec_tokens if draft_source is not None else 0
        self.context_window: int = runner.config.context_window  # type: ignore[attr-defined]
        self.totals = EngineTotals()
        self.steps = 0  # forward passes run
        if getattr(runner, "per_sequence_state", False):
            # linear-attention layers' state lives outside the KV pool: a sequence reusing
            # another's prefix blocks would skip positions that state never saw
            budgeted = getattr(runner, "max_running", max_running)
            if max_running > budgeted:
                raise ValueError(f"max_running {max_running} exceeds the {budgeted} sequences "
                                 "whose linear-attention state the runner budgeted")
            if prefix_reuse:
                log.info("prefix reuse off: the model's linear-attention layers keep a "
                         "recurrent state per sequence, which shared KV blocks do not carry")
                prefix_reuse = False
        runner.kv.claim(self)  # the scheduler's block manager hands out the KV pool's blocks
        self.scheduler = Scheduler(
            BlockManager(runner.kv.num_blocks, runner.kv.block_size, prefix_reuse,
                         partial_reuse=not runner.kv.quantized), max_running,
            max(max_step_tokens, max_running), clock=time.perf_counter)
        log.info("scheduler: up to %d running sequences, %d tokens per step, prefix reuse %s",
                 max_running, self.scheduler.max_step_tokens, "on" if prefix_reuse else "off")
        self._intake: collections.deque[SeqState] = collections.deque()
        self._between_steps: collections.deque[Callable[[], None]] = collections.deque()
        # Called by the loop thread after each step, once the step's events are all emitted:
        # a transport can send them together (server.Outbox).
        self.after_step: Callable[[], None] = lambda: None
        self._seq_ids = itertools.count()
        self._grammars: Grammars | None = None  # built at the first constrained request
        self._wakeup = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="strata-engine-loop", daemon=True)

    # -- lifecycle ---------------------------------------------------------------------------
    holds_kv = True  # until stop() hands the pool back

    def start(self) -> None:
        # The loop thread is where the kernels run from now on: the caller's OpenMP workers
        # (the model was loaded here) would only slow every region down (release_thread_pool)
        kernels.release_thread_pool()
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop after the current step; every request not finished ends with an abort."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify_all()
        self._thread.join(timeout_s)
        if self.step_trace is not None:
            self.step_trace.close()
        pending = [*self._intake, *self.scheduler.running, *self.scheduler.waiting]
        self._intake.clear()
        for seq in pending:
            self._finish(seq, "abort", "engine shutting down")
        if not self._thread.is_alive():
            self.runner.kv.claim(None)  # another engine or driver may take the pool now
        if self._grammars is not None:
            self._grammars.close()

    def call_between_steps(self, fn: Callable[[], None]) -> None:
        """Run fn on the loop thread, which owns the runner, before the next step (a new plan's
        cache fill, say); exceptions are logged, not raised."""
        with self._wakeup:
            self._between_steps.append(fn)
            self._wakeup.notify()

    @property
    def num_waiting(self) -> int:
        return len(self._intake) + len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # -- requests ----------------------------------------------------------------------------
    def submit(self, request: EngineRequest, sink: Sink) -> RequestHandle:
        """Tokenize and validate; raises InvalidRequest before any event, else emits Started."""
        prompt_ids = self._tokenize(request)
        if len(prompt_ids) >= self.context_window:
            raise PromptTooLong(len(prompt_ids), self.context_window)
        params = request.params
        self._check_ids("logit_bias", [i for i, _ in params.sampling.logit_bias])
        self._check_ids("stop_token_ids", params.stop_token_ids)
        if self._stopping:
            raise RuntimeError("engine is shutting down")
        try:
            constraint = self._constraint(request)
        except GrammarError as exc:  # a JSON schema that is no JSON, placed in a grammar
            raise InvalidRequest(f"output constraint: {exc}") from None
        guide = self._guide(constraint)
        if params.echo and request.prompt is None:
            raise InvalidRequest("echo: only a completion prompt is echoed", "echo")
        if params.echo_only and not params.echo:
            raise InvalidRequest("max_tokens 0 asks for the prompt alone: it needs echo",
                                 "max_tokens")
        handle = RequestHandle(request, prompt_ids, sink)
        live = _Live(handle, self.runner.tokenizer, self.context_window, guide)
        vocab = self.runner.config.vocab_size  # type: ignore[attr-defined]
        seq = SeqState(next(self._seq_ids), list(prompt_ids), len(prompt_ids),
                       arrived_at=handle.submitted_at, payload=live,
                       reuse_prefix=not live.scoring,
                       max_chunk=max(1, SCORE_LOGITS_BYTES // (4 * vocab)) if live.scoring
                       else 0)
        fmt = self.runner.tokenizer.tool_call_format  # type: ignore[attr-defined]
        sink(Started(len(prompt_ids), self.context_window, fmt if request.tools or (
            request.messages is not None and fmt in CHANNELED) else ""))
        with self._wakeup:
            self._intake.append(seq)
            self._wakeup.notify()
        return handle

    # -- the tokenizer, as prompts meet it (for clients that count or build token ids) ---------
    def tokenize(self, text: str) -> list[int]:
        """A text's ids as a completion prompt becomes: no special tokens added."""
        return list(self.runner.tokenizer.encode(text))  # type: ignore[attr-defined]

    def prompt_ids(self, request: EngineRequest) -> list[int]:
        """The ids a request's prompt becomes, as `submit` makes them (a chat through the
        template, with the generation prompt); InvalidRequest where submit would refuse it."""
        return self._tokenize(request)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Ids' text, special tokens kept; an id outside the vocabulary is an InvalidRequest."""
        self._check_ids("tokens", ids)
        return self.runner.tokenizer.decode(list(ids),  # type: ignore[attr-defined]
                                            skip_special_tokens=False)

    def tokenizer_info(self) -> TokenizerInfo:
        tokenizer, config = self.runner.tokenizer, self.runner.config
        return TokenizerInfo(
            tokenizer.bos_token or "", tokenizer.eos_token or "",  # type: ignore[attr-defined]
            tuple(sorted(tokenizer.eos_token_ids)),  # type: ignore[attr-defined]
            tokenizer.chat_template or "",  # type: ignore[attr-defined]
            config.vocab_size, self.context_window)  # type: ignore[attr-defined]

    def _check_ids(self, name: str, ids: Iterable[int]) -> None:
        """An id outside the vocabulary is an InvalidRequest naming the field `name`."""
        vocab = self.runner.config.vocab_size  # type: ignore[attr-defined]
        bad = next((i for i in ids if not 0 <= i < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"{name}: token id {bad} outside the vocabulary of {vocab}",
                                 name)

    def _constraint(self, request: EngineRequest) -> OutputConstraint | None:
        """What the output must match. A required or named tool choice: that call. A chat
        answer held to JSON (response_format, guided_json) is the answer the template's shape
        holds: with tools, the JSON or the calls; in harmony, the final message's content.
        With a `strict` function the calls always parse and follow its parameters, the text
        without a call staying free. A regex or Lark grammar holds the whole output as the
        model writes it, calls included."""
        tools, constraint = request.tools, request.params.constraint
        fmt = self.runner.tokenizer.tool_call_format  # type: ignore[attr-defined]
        answer = constraint if (constraint is not None and constraint.kind in JSON_KINDS
                                and request.messages is not None) else None
        if tools is not None and tools.allowed:
            self._check_allowed(tools)
        if tools is not None and tools.choice != "auto":
            if constraint is not None:
                raise InvalidRequest("a required tool call and an output constraint both "
                                     "decide the output's form; give one")
            return tool_call_constraint(fmt, tools.callable_json, tools.choice, tools.parallel)
        if tools is not None and (tools.strict or tools.allowed or answer is not None):
            if constraint is not None and answer is None:
                raise InvalidRequest("a strict function's calls (tools[].function.strict) or "
                                     "allowed_tools, and a regex or grammar, both decide the "
                                     "output's form; give one")
            return tool_call_constraint(fmt, tools.callable_json, "auto", tools.parallel,
                                        answer)
        if answer is not None and fmt in CHANNELED:
            return final_answer_constraint(answer)
        return constraint

    @staticmethod
    def _check_allowed(tools: ToolSpec) -> None:
        names = {t.get("function", {}).get("name") for t in json.loads(tools.tools_json)}
        if (unknown := next((n for n in tools.allowed if n not in names), None)) is not None:
            raise InvalidRequest(f"allowed_tools names {unknown!r}, which is not in tools",
                                 "tool_choice")

    def _guide(self, constraint: OutputConstraint | None) -> Guide | None:
        """The request's grammar matcher (constrained decoding); InvalidRequest naming the
        problem when the constraint does not compile."""
        if constraint is None:
            return None
        if self._grammars is None:
            device = getattr(self.runner, "device", None)
            self._grammars = Grammars(
                self.runner.tokenizer, self.runner.config.vocab_size,  # type: ignore[attr-defined]
                getattr(self.runner, "model_dir", None),
                overlap=getattr(device, "type", "cpu") != "cpu"
                or torch.get_num_threads() < available_cores())
        try:
            return self._grammars.guide(constraint)
        except GrammarError as exc:
            raise InvalidRequest(f"output constraint: {exc}") from None

    def _tokenize(self, request: EngineRequest) -> list[int]:
        tokenizer = self.runner.tokenizer
        if request.tools is not None and not tokenizer.tool_call_format:  # type: ignore[attr-defined]
            raise InvalidRequest(
                "tools: this model's chat template teaches no tool-call syntax Strata parses "
                f"(it knows {', '.join(sorted(TOOL_CALL_SYNTAXES))}); send the request "
                "without tools")
        if request.messages is not None:
            if not request.messages:
                raise InvalidRequest("messages must not be empty")
            self._check_names(request.messages)
            extra = {} if request.tools is None else {
                "tools": json.loads(request.tools.tools_json)}
            extra.update(self._template_kwargs(request))
            try:
                text = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
                    [m.as_template_message(tokenizer.tool_call_format in ARGUMENTS_AS_OBJECT)
                     if isinstance(m, ChatTurn)
                     else {"role": m[0], "content": m[1]} for m in request.messages],
                    add_generation_prompt=True, **extra)
            except ValueError as exc:  # the template rejected the conversation
                raise InvalidRequest(str(exc)) from exc
        elif isinstance(request.prompt, tuple):  # token ids: taken as they are
            self._check_ids("prompt", request.prompt)
            if not request.prompt:
                raise InvalidRequest("prompt is empty", "prompt")
            return list(request.prompt)
        else:
            text = request.prompt or ""
            if request.suffix:
                fim = tokenizer.fim_tokens  # type: ignore[attr-defined]
                if fim is None:
                    raise InvalidRequest("suffix: this model's vocabulary has no fill-in-the-"
                                         "middle tokens, so it cannot write between a prompt "
                                         "and a suffix; send the prompt alone",
                                         "suffix", "unsupported_parameter")
                text = f"{fim[0]}{text}{fim[1]}{request.suffix}{fim[2]}"
        ids = tokenizer.encode(text)  # type: ignore[attr-defined]
        if not ids:
            raise InvalidRequest("prompt is empty")
        return list(ids)

    def _template_kwargs(self, request: EngineRequest) -> dict[str, Any]:
        """The request's template variables (chat_template_kwargs, reasoning_effort), each one
        the model's chat template reads: one it does not would be ignored, so it is refused."""
        if not request.template_kwargs and not request.reasoning_effort:
            return {}
        variables = self.runner.tokenizer.template_variables  # type: ignore[attr-defined]
        readable = sorted(variables - TEMPLATE_OWN_VARIABLES)
        reads = f"it reads {', '.join(readable)}" if readable else "it reads no others"
        out: dict[str, Any] = {}
        for name, value in request.template_kwargs:
            param = f"chat_template_kwargs.{name}"
            if name in TEMPLATE_OWN_VARIABLES:
                raise InvalidRequest(f"{param}: Strata sets '{name}' itself, from the request",
                                     param)
            if name not in variables:
                raise InvalidRequest(f"{param}: this model's chat template does not read "
                                     f"'{name}' ({reads}), so it would be ignored; send the "
                                     "request without it", param, "unsupported_parameter")
            out[name] = value
        if request.reasoning_effort:
            if "reasoning_effort" not in variables:
                raise InvalidRequest("reasoning_effort: this model's chat template has no "
                                     f"reasoning effort to set ({reads}), so it would be "
                                     "ignored; send the request without it", "reasoning_effort",
                                     "unsupported_parameter")
            if "reasoning_effort" in out:
                raise InvalidRequest("reasoning_effort is given twice, also in "
                                     "chat_template_kwargs; give one", "reasoning_effort")
            out["reasoning_effort"] = request.reasoning_effort
        return out

    def _check_names(self, messages: Sequence[tuple[str, str] | ChatTurn]) -> None:
        """A participant name the chat template would drop is refused, not ignored."""
        for i, m in enumerate(messages):
            if isinstance(m, ChatTurn) and m.name and \
                    m.role not in self.runner.tokenizer.named_roles:  # type: ignore[attr-defined]
                raise InvalidRequest(
                    f"messages[{i}].name: this model's chat template does not show a {m.role} "
                    "message's name to the model, so it would be ignored; send the message "
                    "without 'name' (or write the name into its content)",
                    f"messages[{i}].name", "unsupported_parameter")

    # -- loop thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        sched = self.scheduler
        while True:
            with self._wakeup:
                while not (self._intake or self._between_steps or self._stopping
                           or sched.has_work):
                    self._wakeup.wait()
                if self.gather_s > 0 and self._intake and not sched.has_work:
                    self._gather()
                if self._stopping:
                    return
                chores = list(self._between_steps)
                self._between_steps.clear()
                arrived = list(self._intake)
                self._intake.clear()
            for chore in chores:
                try:
                    chore()
                except Exception:
                    log.exception("work between engine steps failed; the engine keeps serving")
            for seq in arrived:
                sched.add(seq)
            for seq in (*sched.running, *sched.waiting):
                seq.cancelled = seq.payload.handle.cancelled.is_set()
            try:
                self._step()
            except Exception:  # the loop must outlive any one step
                log.exception("engine step failed outside the model; the engine keeps serving")
            self.after_step()

    def _gather(self) -> None:
        """Hold an idle engine's first step (the wakeup lock held) until the requests that its
        arrivals say follow them have arrived too: a gateway forwards a burst one request after
        another, and a request that misses the first step waits that whole step for its first
        token. At most gather_s, and at most a step's time: a follower later than that does
        better in the next step than the others waiting for it."""
        deadline = time.perf_counter() + min(self.gather_s, self._step_s)
        expected = seen = 0
        while True:
            for seq in itertools.islice(self._intake, seen, None):
                seen += 1  # this arrival, and those it says follow it
                expected = max(expected, seen + seq.payload.handle.request.following)
            left = deadline - time.perf_counter()
            if seen >= expected or left <= 0 or self._stopping:
                return
            self._wakeup.wait(left)

    def _step(self) -> None:
        self._propose_drafts()
        step = self.scheduler.schedule()
        for seq in step.dropped:
            self._finish(seq, "abort", "cancelled by the client")
        for seq in step.preempted:  # recomputed later from its tokens alone
            self._release(seq)
        if not step.chunks:
            return
        self.runner.kv.copy_blocks(step.copies)  # prompts starting with part of a cached block
        # the chunks of a prompt whose logprobs are asked for (echo) want every position's
        scoring = [c.seq.payload.scoring for c in step.chunks]
        work = [chunk_work(c, every_position=True, logits=True) if score else chunk_work(c)
                for c, score in zip(step.chunks, scoring, strict=True)]
        self.steps += 1
        for chunk in step.chunks:  # grammar masks: computed while the forward runs
            if chunk.samples and (guide := chunk.seq.payload.sampler.guide) is not None:
                guide.start_mask()
        started = time.perf_counter()
        try:
            results: list = self.runner.step(work)  # type: ignore[attr-defined]
            picks = None if any(scoring) else self._greedy_picks(step.chunks)
        except Exception as exc:
            results, picks = self._isolate(work, exc), None
        forward_s = time.perf_counter() - started
        self._step_s += 0.25 * (forward_s - self._step_s)
        ran = [c for c, r in zip(step.chunks, results, strict=True) if r is not None]
        self.scheduler.complete(Step(tuple(ran)))
        for i, (chunk, w, result) in enumerate(zip(step.chunks, work, results, strict=True)):
            seq = chunk.seq
            if result is None:
                self._finish(seq, "abort", "engine error while computing this request; "
                                           "the engine log has the traceback")
                continue
            logits, counters = result
            live: _Live = seq.payload
            live.cache.add(counters, prefill=w.prefill)
            if not (chunk.samples or scoring[i]):
                continue
            try:
                if scoring[i]:
                    logits = self._score_prompt(chunk, logits)
                if chunk.samples:
                    if live.echo_due:
                        live.echo_due = False
                        live.handle.sink(self._echo(live))
                    if live.max_new == 0:  # echo_only: the prompt was all it asked for
                        self._finish(seq, "length")
                        continue
                    if chunk.draft:
                        self._verify(chunk, logits, counters)
                    elif picks is not None:
                        self._take(seq, picks[i], logits)
                    else:
                        self._advance(seq, logits)
                    live.flush()  # one Delta per request and step, however many tokens
            except Exception as exc:
                log.exception("request %s failed after its step", live.handle.request.request_id)
                self._finish(seq, "abort", f"engine error: {type(exc).__name__}: {exc}")
        if self.step_trace is not None:
            self.step_trace.record(
                started, forward_s, time.perf_counter() - started - forward_s, len(work),
                sum(len(w.token_ids) for w in work),
                sum(len(w.token_ids) for w in work if w.prefill))

    def _greedy_picks(self, chunks: Sequence[Chunk]) -> list[int] | None:
        """The tokens of a step whose every chunk samples one token by plain argmax (greedy,
        nothing to process: the usual decode step), in one vectorized argmax over the step's
        logits rows, which are the chunks' in order; None when any chunk samples otherwise
        (each then samples its own row). Default model, eight rows: 188 us of a 2.9 ms step
        a row at a time."""
        if len(chunks) < 2 or not all(c.samples and not c.draft
                                      and c.seq.payload.sampler.plain_greedy for c in chunks):
            return None
        logits = self.runner.step_logits
        assert logits is not None and logits.shape[0] == len(chunks)
        return argmax_ids(logits)

    def _isolate(self, work: list, exc: Exception) -> list:
        """A batched step failed: run its chunks one by one so only the failing ones end."""
        log.warning("a step of %d chunks failed (%s: %s); retrying them one at a time",
                    len(work), type(exc).__name__, exc)
        results: list = []
        for w in work:
            try:
                [result] = self.runner.step([w])  # type: ignore[attr-defined]
            except Exception:
                log.exception("a chunk at position %d failed on its own", w.pos_start)
                result = None
            results.append(result)
        return results

    def _propose_drafts(self) -> None:
        """Give every decoding sequence up to spec_tokens drafts, never more than it may still
        emit after the verification's own token (max_tokens, the context window)."""
        if self.draft_source is None:
            return
        wanting: list[SeqState] = []
        requests: list[DraftRequest] = []
        for seq in self.scheduler.running:
            live: _Live = seq.payload
            limit = min(self.spec_tokens, live.max_new - live.generated - 1)
            if live.sampler.cfg.history_dependent:
                limit = 0  # each verified row would need its own penalty history
            if seq.num_pending == 1 and limit > 0 and not seq.cancelled:
                wanting.append(seq)
                requests.append(DraftRequest(seq.seq_id, seq.token_ids, seq.prompt_len, limit))
        if not requests:
            return
        lookups_before = self.draft_source.draft_lookups
        try:
            drafts = self.draft_source.propose(requests)
        except Exception:  # drafts are an optimisation: decode without them this step
            log.exception("the draft source failed; this step decodes without drafts")
            return
        spent = self.draft_source.draft_lookups - lookups_before
        share, extra = divmod(spent, len(requests))  # the source's forward, shared
        vocab = self.runner.config.vocab_size  # type: ignore[attr-defined]
        for i, (seq, request, draft) in enumerate(zip(wanting, requests, drafts, strict=True)):
            seq.draft = []
            for token in draft[:request.max_tokens]:  # stop at an id the model cannot take
                if not 0 <= int(token) < vocab:
                    break
                seq.draft.append(int(token))
            if (guide := seq.payload.sampler.guide) is not None:  # and at one the grammar would not
                del seq.draft[guide.valid_prefix(seq.draft):]
            seq.payload.draft_lookups += share + (i < extra)

    def _verify(self, chunk: Chunk, logits: torch.Tensor, counters: CacheCounters) -> None:
        """Accept a prefix of the chunk's drafts (verify.py), then emit the accepted tokens and
        the one after them one by one, with the stop checks of plain decoding."""
        seq, live = chunk.seq, chunk.seq.payload
        guide = live.sampler.guide
        live.sampler.rows = guide.row_masks(list(chunk.draft)) if guide is not None else None
        try:
            tokens = accept_tokens(live.sampler, logits, chunk.draft)
        finally:
            live.sampler.rows = None
        accepted = len(tokens) - 1
        live.drafts_proposed += len(chunk.draft)
        live.drafts_accepted += accepted
        live.verify_steps += 1
        live.rejected_lookups += (len(chunk.draft) - accepted) * (
            counters.lookups // (1 + len(chunk.draft)))
        for row, token_id in enumerate(tokens):
            if not self._take(seq, token_id, logits[row]):
                return  # finished: its blocks are freed
        self.scheduler.accept_draft(seq, accepted)
        self.runner.rewind(seq.seq_id, seq.num_computed)

    def _advance(self, seq: SeqState, logits: torch.Tensor) -> None:
        """Sample the next token and take it."""
        live: _Live = seq.payload
        self._take(seq, live.sampler.sample(logits), logits)

    def _take(self, seq: SeqState, token_id: int, logits: torch.Tensor) -> bool:
        """Emit one token's text; finish on EOS, a stop string (or the end of a call the request
        allows only one of) or the limit (returns False), else append it to the sequence
        (True). logits [V]: its distribution, for logprobs."""
        live: _Live = seq.payload
        params = live.handle.request.params
        if live.first_token_at is None:
            live.first_token_at = time.perf_counter()
        if token_id in live.end_ids:  # EOS (unless ignore_eos) or one of stop_token_ids
            live.emit(live.text.flush())
            self._finish(seq, "stop")
            return False
        live.generated += 1
        live.sampler.observe(token_id)
        new_text, hit_stop = live.text.push(token_id)
        live.emit(new_text, token_id, self._logprobs(logits, token_id, params.top_logprobs)
                  if params.logprobs else None)
        if hit_stop:
            self._finish(seq, "stop")
        elif live.sampler.guide is not None and live.sampler.guide.done:
            live.emit(live.text.flush())  # the grammar is complete: nothing more may follow
            self._finish(seq, "stop")
        elif live.generated >= live.max_new:
            live.emit(live.text.flush())
            self._finish(seq, "length")
        else:
            seq.token_ids.append(token_id)
            return True
        return False

    def _finish(self, seq: SeqState, reason: str, error: str = "") -> None:
        """The request's one terminal event: free its blocks, log, account, tell the client."""
        self.scheduler.finish(seq)
        self._release(seq)
        live: _Live = seq.payload
        stats = live.stats(seq, time.perf_counter())
        if seq.admitted_at is not None:
            self._log_request(stats)
        self.totals.add(stats)
        live.flush()
        live.handle.sink(Finished(reason, stats, error))

    def _release(self, seq: SeqState) -> None:
        """What the runner and the draft source keep for a sequence beyond its KV blocks."""
        self.runner.release(seq.seq_id)
        if self.draft_source is not None:
            self.draft_source.release(seq.seq_id)

    def _logprobs(self, logits: torch.Tensor, token_id: int, num_top: int) -> TokenLogprob:
        """Log-probabilities under the model's distribution (before temperature/top-p)."""
        x = logits.float()  # [V]
        lse = torch.logsumexp(x, dim=-1)  # the log_softmax of the ids asked for only
        top: tuple[TopLogprob, ...] = ()
        if num_top:
            ids = top_ids(x, num_top)
            top = tuple(self._top_logprob(tid, value)
                        for value, tid in zip((x[ids] - lse).tolist(), ids, strict=True))
        return self._token_logprob(token_id, float(x[token_id] - lse), top)

    def _score_prompt(self, chunk: Chunk, rows: torch.Tensor) -> torch.Tensor:
        """A prefill chunk's logits at every position [T, V]: each row but a sampling chunk's
        last scores the prompt token after it into the request's echo logprobs. Returns the
        row to sample from (the last)."""
        seq, live = chunk.seq, chunk.seq.payload
        num_top = live.handle.request.params.top_logprobs
        out = live.echo_logprobs
        if chunk.start == 0:  # nothing before the first token: no logprob (OpenAI's null)
            out.append(self._token_logprob(seq.token_ids[0], 0.0))
        # row r (position start + r) scores the token after it, up to the prompt's last
        targets = seq.token_ids[chunk.start + 1:min(chunk.end + 1, seq.prompt_len)]
        if not targets:
            return rows[-1]
        # All rows at once: 0.52 ms a row at 151936 tokens against 1.70 a row at a time
        # (scripts/score_cost.py)
        x = rows[:len(targets)].float()
        lse = torch.logsumexp(x, dim=-1)
        values = (x.gather(1, torch.tensor(targets, device=x.device)[:, None])[:, 0]
                  - lse).tolist()
        tops: list[list[tuple[float, int]]] = [[] for _ in targets]
        if num_top:
            top_values, top_ids_ = torch.topk(x, min(num_top, x.shape[1]), dim=-1)
            tops = [sorted(zip(v, i, strict=True), key=lambda t: (-t[0], t[1]))
                    for v, i in zip((top_values - lse[:, None]).tolist(), top_ids_.tolist(),
                                    strict=True)]
        for tid, value, top in zip(targets, values, tops, strict=True):
            out.append(self._token_logprob(tid, value, tuple(
                self._top_logprob(t, v) for v, t in top)))
        return rows[-1]

    def _token_logprob(self, token_id: int, value: float,
                       top: tuple[TopLogprob, ...] = ()) -> TokenLogprob:
        token, raw = self._describe(token_id)
        return TokenLogprob(token_id, token, value, raw, top)

    def _top_logprob(self, token_id: int, value: float) -> TopLogprob:
        token, raw = self._describe(token_id)
        return TopLogprob(token_id, token, value, raw)

    def _echo(self, live: _Live) -> Echo:
        request = live.handle.request
        text = request.prompt if isinstance(request.prompt, str) else \
            self.runner.tokenizer.decode(list(live.handle.prompt_ids),  # type: ignore[attr-defined]
                                         skip_special_tokens=False)
        return Echo(text, tuple(live.echo_logprobs or ()))

    def _describe(self, token_id: int) -> tuple[str, bytes]:
        raw = self.runner.tokenizer.token_bytes(token_id)  # type: ignore[attr-defined]
        return raw.decode("utf-8", errors="backslashreplace"), raw

    def _log_request(self, s: RequestStats) -> None:
        d = s.decode
        # The two per-request lines of design.md section 1, paired in order by `strata bench dataset`.
        serve_log.info(
            "strata serve: prompt %d tokens = %d reused + %d read in %.0f ms, "
            "%d generated in %.0f ms (%.1f tok/s)%s",
            s.prompt_tokens, s.reused_prompt_tokens, s.prompt_tokens - s.reused_prompt_tokens,
            s.prefill_ms, s.completion_tokens, s.decode_ms, s.decode_tok_s,
            f", drafts accepted {s.drafts_accepted}/{s.drafts_proposed}"
            if self.draft_source is not None else "")
        serve_log.info(
            "strata serve: decode expert cache hit rate: %.1f%% (%d hits / %d lookups); "
            "%d more spilled, served by no cache slot (%.2f%% of all %d routed); "
            "misses by placement: %d run from host memory, %d copied over the link first%s",
            100 * d.hit_rate, d.hits, d.lookups, d.spilled, 100 * d.spill_ratio, d.lookups,
            d.misses_host, d.misses_copied,
            f"; prefetch precision {100 * d.prefetch_precision:.1f}% recall "
            f"{100 * d.prefetch_recall:.1f}%" if d.predicted else "")
