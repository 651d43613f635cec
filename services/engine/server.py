"""gRPC transport for the engine: the Engine service, standard health, cache-manager client.

Proto messages stop here: requests become core dataclasses at once, core events become protos
on the way out. Core errors map to gRPC status codes in one place (`_status_for`).

Each Generate call is a server span whose parent is the caller's (W3C `traceparent` in the gRPC
metadata: one trace from the gateway through the engine), and ends with one line in the log
naming its request id and trace id and one record in the GenAI request metrics.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Span, SpanKind, StatusCode

from services.common import counters
from services.common.genai_metrics import GenAIMetrics
from services.common.pb.strata.v1 import engine_pb2, engine_pb2_grpc
from services.common.rpc_errors import CODE_KEY, PARAM_KEY
from services.common.telemetry import extract_context
from services.engine.core import Engine
from services.engine.grammar import OutputConstraint
from services.engine.requests import (
    ChatTurn,
    Delta,
    Echo,
    EngineRequest,
    Event,
    Finished,
    GenerateParams,
    InvalidRequest,
    RequestStats,
    Started,
    TokenLogprob,
    ToolSpec,
)
from services.engine.sampling import SamplingConfig

log = logging.getLogger("strata.engine")
# How long the engine's loop thread waits, after a step, for the first messages of the requests
# that step started to be written, before it takes the cores for the next step.
FIRST_MESSAGE_WAIT_S = 0.003
# ... and then leaves the cores to the gateway this long, where its threads take them all.
FIRST_TOKEN_GRACE_MS = 1.0
MAX_TOP_LOGPROBS = 20


def first_token_grace_s(setting_ms: float | None, device: str, threads: int, cores: int
                        ) -> float:
    """The Outbox's grace after first messages: the setting, or (auto) FIRST_TOKEN_GRACE_MS
    on the CPU when the engine's `threads` take all of its `cores`, else none (a GPU's step
    leaves the CPU's cores to the gateway, as does a CPU engine with a core to spare)."""
    if setting_ms is None:
        setting_ms = FIRST_TOKEN_GRACE_MS if device == "cpu" and threads >= cores else 0.0
    return setting_ms / 1e3


_FINISH = {
    "stop": engine_pb2.FINISH_REASON_STOP,
    "length": engine_pb2.FINISH_REASON_LENGTH,
    "abort": engine_pb2.FINISH_REASON_ABORT,
}


def request_from_proto(msg: engine_pb2.GenerateRequest) -> EngineRequest:
    s = msg.sampling
    if (s.temperature < 0 or not 0 <= s.top_p <= 1 or s.top_k < 0 or s.max_tokens < 0
            or not 0 <= s.top_logprobs <= MAX_TOP_LOGPROBS):
        raise InvalidRequest("sampling parameters out of range: temperature >= 0, "
                             "0 <= top_p <= 1, top_k >= 0, max_tokens >= 0, "
                             f"0 <= top_logprobs <= {MAX_TOP_LOGPROBS}")
    try:
        sampling = SamplingConfig(
            temperature=s.temperature, top_p=s.top_p or 1.0, top_k=s.top_k,
            seed=s.seed if s.HasField("seed") else None, min_p=s.min_p,
            presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
            repetition_penalty=s.repetition_penalty or 1.0,
            logit_bias=tuple(sorted(s.logit_bias.items())), min_tokens=s.min_tokens)
    except ValueError as e:
        raise InvalidRequest(f"sampling parameters out of range: {e}") from None
    params = GenerateParams(
        max_tokens=s.max_tokens,
        stop=tuple(s.stop),
        logprobs=s.logprobs or s.top_logprobs > 0,
        top_logprobs=s.top_logprobs,
        ignore_eos=s.ignore_eos,
        stop_token_ids=tuple(s.stop_token_ids), echo=s.echo, echo_only=s.echo_only,
        sampling=sampling, constraint=constraint_from_proto(msg))
    request_id = msg.request_id or uuid.uuid4().hex
    which = msg.WhichOneof("input")
    if msg.suffix and which != "prompt":
        raise InvalidRequest("suffix: fill in the middle takes a text prompt", "suffix")
    if which == "chat":
        return chat_request(msg.chat, request_id, params, msg.following)
    if which == "prompt":
        return EngineRequest(request_id, params, prompt=msg.prompt, following=msg.following,
                             suffix=msg.suffix)
    if which == "prompt_token_ids":
        return EngineRequest(request_id, params, prompt=tuple(msg.prompt_token_ids.ids),
                             following=msg.following)
    raise InvalidRequest("request has neither chat messages nor a prompt")


def chat_request(chat: engine_pb2.ChatInput, request_id: str, params: GenerateParams,
                 following: int = 0) -> EngineRequest:
    messages = tuple(
        ChatTurn(m.role, m.content, tuple((c.id, c.name, c.arguments) for c in m.tool_calls),
                 m.tool_call_id, m.name, m.reasoning_content)
        if m.tool_calls or m.tool_call_id or m.name or m.reasoning_content
        else (m.role, m.content)
        for m in chat.messages)
    tools = ToolSpec(chat.tools_json, chat.tool_choice or "auto", chat.parallel_tool_calls,
                     tuple(chat.allowed_tools)) if chat.tools_json else None
    kwargs: Any = {}
    if chat.template_kwargs_json:
        try:
            kwargs = json.loads(chat.template_kwargs_json)
        except ValueError:
            kwargs = None
        if not isinstance(kwargs, dict):
            raise InvalidRequest("chat_template_kwargs must be a JSON object",
                                 "chat_template_kwargs")
    return EngineRequest(request_id, params, messages=messages, tools=tools, following=following,
                         template_kwargs=tuple(sorted(kwargs.items())),
                         reasoning_effort=chat.reasoning_effort)


def constraint_from_proto(msg: engine_pb2.GenerateRequest) -> OutputConstraint | None:
    if not msg.HasField("constraint"):
        return None
    kind = msg.constraint.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        return OutputConstraint("json_object") if msg.constraint.json_object else None
    return OutputConstraint(kind, getattr(msg.constraint, kind))


def stats_to_proto(s: RequestStats) -> engine_pb2.RequestStats:
    return engine_pb2.RequestStats(
        prompt_tokens=s.prompt_tokens, reused_prompt_tokens=s.reused_prompt_tokens,
        completion_tokens=s.completion_tokens, queue_ms=s.queue_ms, prefill_ms=s.prefill_ms,
        decode_ms=s.decode_ms, ttft_ms=s.ttft_ms, decode_tok_s=s.decode_tok_s,
        decode=counters.to_proto(s.decode), prefill=counters.to_proto(s.prefill),
        drafts_proposed=s.drafts_proposed,
        drafts_accepted=s.drafts_accepted, draft_acceptance_rate=s.draft_acceptance_rate,
        verify_steps=s.verify_steps, rejected_lookups=s.rejected_lookups,
        draft_lookups=s.draft_lookups)


def message_of(events: Sequence[Event], engine_id: str) -> engine_pb2.GenerateEvent:
    """One message for what a wake-up of the event loop delivered to a call: its Started, its
    Echo, its tokens (the deltas joined: a reader that fell behind gets what piled up at once),
    its Finished. The engine emits them in that order."""
    message = engine_pb2.GenerateEvent()
    deltas: list[Delta] = []
    for event in events:
        if isinstance(event, Delta):
            deltas.append(event)
        elif isinstance(event, Started):
            message.started.CopyFrom(engine_pb2.Started(
                prompt_tokens=event.prompt_tokens, context_window=event.context_window,
                engine_id=engine_id, tool_call_format=event.tool_call_format))
        elif isinstance(event, Echo):
            message.echo.CopyFrom(engine_pb2.PromptEcho(
                text=event.text, logprobs=[_logprob_to_proto(lp) for lp in event.logprobs]))
        elif isinstance(event, Finished):
            message.finished.CopyFrom(engine_pb2.Finished(
                reason=_FINISH[event.reason], stats=stats_to_proto(event.stats),
                error=event.error))
    if deltas:
        delta = Delta.join(deltas)
        message.delta.CopyFrom(engine_pb2.TokenDelta(
            text=delta.text, token_ids=list(delta.token_ids),
            logprobs=[_logprob_to_proto(lp) for lp in delta.logprobs]))
    return message


def _logprob_to_proto(lp: TokenLogprob) -> engine_pb2.TokenLogprob:
    return engine_pb2.TokenLogprob(
        token_id=lp.token_id, token=lp.token, logprob=lp.logprob, bytes=lp.token_bytes,
        top=[engine_pb2.TopLogprob(token_id=t.token_id, token=t.token, logprob=t.logprob,
                                   bytes=t.token_bytes) for t in lp.top])


class EngineServicer(engine_pb2_grpc.EngineServicer):
    def __init__(self, engine: Engine, status: StatusSource, *,
                 meter_provider: MeterProvider | None = None,
                 tracer_provider: TracerProvider | None = None,
                 first_token_grace_s: float = 0.0):
        self._engine = engine
        self._first_token_grace_s = first_token_grace_s
        self._status = status
        self._outbox: Outbox | None = None  # made on the server's event loop
        # Without providers: spans still carry ids (for the log), nothing is exported.
        self._tracer = (tracer_provider or TracerProvider()).get_tracer("strata.engine")
        meter = (meter_provider or MeterProvider()).get_meter("strata.engine")
        self.metrics = GenAIMetrics(meter)
        self.metrics.set_load_source(
            lambda: (engine.num_running, engine.num_waiting, kv_usage(engine)))
        _spec_instruments(meter, engine)

    async def Generate(self, request: engine_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[engine_pb2.GenerateEvent]:
        call = _Call(request, self._status.model_name, time.perf_counter(), self._tracer.start_span(
            "generate", context=extract_context(context.invocation_metadata()),
            kind=SpanKind.SERVER))
        try:
            async for message in self._generate(request, context, call):
                yield message
        except BaseException as exc:
            call.error_type = call.error_type or _error_type(exc)
            raise
        finally:
            call.end(self.metrics, self._status.engine_id)

    async def _generate(self, request: engine_pb2.GenerateRequest,
                        context: grpc.aio.ServicerContext, call: _Call
                        ) -> AsyncIterator[engine_pb2.GenerateEvent]:
        if self._outbox is None:
            self._outbox = Outbox(asyncio.get_running_loop(), self._first_token_grace_s)
            self._engine.after_step = self._outbox.flush
        inbox = Inbox(max(request.stream_interval_ms, 0.0) / 1e3)
        try:
            handle = self._engine.submit(request_from_proto(request),
                                         functools.partial(self._outbox.put, inbox))
        except InvalidRequest as exc:
            call.error_type = "invalid_request"
            await _abort_invalid(context, exc)
        except RuntimeError as exc:
            call.error_type = "unavailable"
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        try:
            while True:
                events = await inbox.take()  # what piled up, or else the next step's
                yield message_of(events, self._status.engine_id)
                inbox.first_out()
                for event in events:
                    if isinstance(event, Started):
                        call.prompt_tokens = event.prompt_tokens
                    elif isinstance(event, Finished):
                        call.finished = event
                        return
        finally:
            # Client gone (or stream closed early): stop generating for it.
            handle.cancel()

    async def GetStatus(self, request: engine_pb2.GetStatusRequest,
                        context: grpc.aio.ServicerContext) -> engine_pb2.EngineStatus:
        return self._status.status()

    # A long text's tokenization runs off the event loop, which streams the running requests.
    async def Tokenize(self, request: engine_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> engine_pb2.TokenIds:
        if request.WhichOneof("input") == "chat":
            chat = chat_request(request.chat, "tokenize", GenerateParams())
            try:
                ids = await asyncio.to_thread(self._engine.prompt_ids, chat)
            except InvalidRequest as exc:
                await _abort_invalid(context, exc)
            return engine_pb2.TokenIds(ids=ids)
        return engine_pb2.TokenIds(ids=await asyncio.to_thread(self._engine.tokenize,
                                                               request.text))

    async def Detokenize(self, request: engine_pb2.TokenIds,
                         context: grpc.aio.ServicerContext) -> engine_pb2.DetokenizeResponse:
        try:
            text = await asyncio.to_thread(self._engine.detokenize, list(request.ids))
        except InvalidRequest as exc:
            await _abort_invalid(context, exc)
        return engine_pb2.DetokenizeResponse(text=text)

    async def GetTokenizerInfo(self, request: engine_pb2.GetTokenizerInfoRequest,
                               context: grpc.aio.ServicerContext) -> engine_pb2.TokenizerInfo:
        info = self._engine.tokenizer_info()
        return engine_pb2.TokenizerInfo(
            bos_token=info.bos_token, eos_token=info.eos_token,
            eos_token_ids=info.eos_token_ids, chat_template=info.chat_template,
            vocab_size=info.vocab_size, context_window=info.context_window,
            model=self._status.model_name)


async def _abort_invalid(context: grpc.aio.ServicerContext, exc: InvalidRequest) -> NoReturn:
    """INVALID_ARGUMENT, the field at fault in the trailers (the gateway's 400 names it)."""
    if exc.param is not None:
        context.set_trailing_metadata(((PARAM_KEY, exc.param), (CODE_KEY, exc.code)))
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


class Inbox:
    """One call's events, in order. The Outbox adds them (the engine's loop thread at the end
    of a step, other threads at once); the call's coroutine takes them.

    Tokens are held for the call's stream interval: after a message with tokens, the next
    ones may be taken interval_s later (the first at once; a Finished, with what came before
    it, at once). The coroutine is woken only when it waits and there is something it may
    take: the steps in between wake nothing, and whether held tokens have come due is judged
    by the engine's loop thread at each step's end (Outbox.flush), so no call runs a timer and
    every message leaves between steps, not in the middle of one."""

    def __init__(self, interval_s: float = 0.0) -> None:
        self._interval_s = interval_s
        self._due = -math.inf  # held tokens may be taken from this time.monotonic() on
        self._lock = threading.Lock()
        self._events: list[Event] = []
        self._waiting = False  # take() found nothing it may take: poll() wakes it
        self.ended = False  # a Finished was added
        self._ready = asyncio.Event()
        self._first_out = threading.Event()  # the call's first message went to gRPC

    def add(self, event: Event) -> None:  # any thread; poll() says whether to wake
        with self._lock:
            self._events.append(event)
            self.ended = self.ended or isinstance(event, Finished)

    def _takeable(self) -> bool:  # the lock held
        return bool(self._events) and (self.ended or time.monotonic() >= self._due)

    def poll(self) -> bool:  # any thread
        """True when the coroutine waits and may now take events: it must be woken (`wake`)."""
        with self._lock:
            if not (self._waiting and self._takeable()):
                return False
            self._waiting = False
            return True

    def wake(self) -> None:  # the event loop
        self._ready.set()

    async def take(self) -> list[Event]:
        """Every event added since the last take, once they may go (waits for that)."""
        while True:
            with self._lock:
                if self._takeable():
                    events, self._events = self._events, []
                    if self._interval_s and any(isinstance(e, Delta) for e in events):
                        self._due = time.monotonic() + self._interval_s
                    return events
                self._waiting = True
                self._ready.clear()
            await self._ready.wait()

    def first_out(self) -> None:  # the event loop, after each message it wrote
        if not self._first_out.is_set():  # a flag read, not the Event's lock, every message
            self._first_out.set()

    def wait_first_out(self, timeout_s: float) -> None:  # the engine's loop thread
        self._first_out.wait(timeout_s)

    def take_nowait(self) -> list[Event]:
        with self._lock:
            events, self._events = self._events, []
            return events


class Outbox:
    """Events from the engine to the calls' inboxes. A step's events for every running
    request cross together, in one wake-up of the event loop at most: events the engine's loop
    thread emits wait for the end of its step (`flush`, the engine's after_step), and so does a
    request's Started once the loop thread is stepping (it goes out with the first tokens
    instead of alone, in the middle of the step that computes them); then the event loop is
    woken only for inboxes whose coroutine waits and may take what they hold (Inbox.poll):
    each flush polls every inbox the loop thread has filled and that has not ended, so held
    tokens leave at the first step's end after their interval, whether or not that step added
    any. Events from any other thread (shutdown's aborts) go to their inbox at once, after any
    that wait for a step's end. A flush that hands over requests' first messages returns once
    they are written (or after FIRST_MESSAGE_WAIT_S), and then `first_token_grace_s` later,
    so that they do not wait for a CPU behind the next step: neither here nor in the process
    that reads them (the gateway)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, first_token_grace_s: float = 0.0) -> None:
        self._loop = loop
        self._grace_s = first_token_grace_s
        self._lock = threading.Lock()
        self._pending: list[tuple[Inbox, Event]] = []  # the step's, until its flush
        self._open: dict[Inbox, None] = {}  # inboxes the loop thread filled, until they end
        self._wake: list[Inbox] = []
        self._scheduled = False
        # the engine loop's thread, once it flushed (the object: a dead thread's ident may be
        # reused by the thread that sends shutdown's aborts)
        self._stepping_thread: threading.Thread | None = None

    def put(self, inbox: Inbox, event: Event) -> None:  # any thread
        with self._lock:
            if threading.current_thread() is self._stepping_thread or (
                    isinstance(event, Started) and self._stepping_thread is not None):
                self._pending.append((inbox, event))
                return
            pending, self._pending = self._pending, []  # what waits goes first: order kept
        self._hand_over([*pending, (inbox, event)])

    def flush(self) -> None:  # the engine's loop thread, after each step
        with self._lock:
            self._stepping_thread = threading.current_thread()
            pending, self._pending = self._pending, []
        for box, _ in pending:
            self._open[box] = None
        self._hand_over(pending, self._open)
        self._open = {box: None for box in self._open if not box.ended}
        # A request's first message (its Started, with the first tokens) leaves before the
        # next step takes the cores: sent while that step runs, it waited for a CPU for up to
        # several ms (c1 TTFT p50 2-8 ms more on the bench preset), all of it time to first token.
        firsts = [box for box, event in pending if isinstance(event, Started)]
        if firsts:
            deadline = time.perf_counter() + FIRST_MESSAGE_WAIT_S
            for box in firsts:
                box.wait_first_out(max(deadline - time.perf_counter(), 0.0))
            # Written is not yet read: the gateway needs a core to forward them, and a step
            # whose threads take every core holds it off until the OS's next tick (3-5 ms at
            # p90 on a 2-core host; docs/benchmarks.md, "The first token's last hop").
            if self._grace_s:
                time.sleep(self._grace_s)

    def _hand_over(self, pending: list[tuple[Inbox, Event]],
                   boxes: Iterable[Inbox] | None = None) -> None:
        """Events into their inboxes; one wake-up of the event loop for the boxes (by default
        the events' own) whose coroutine waits and may now take them."""
        for box, event in pending:
            box.add(event)
        if boxes is None:
            boxes = dict.fromkeys(box for box, _ in pending)
        wake = [box for box in boxes if box.poll()]
        if not wake:
            return
        with self._lock:
            self._wake += wake
            if self._scheduled:
                return
            self._scheduled = True
        self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:  # the event loop
        with self._lock:
            wake, self._wake = self._wake, []
            self._scheduled = False
        for inbox in wake:
            inbox.wake()


class _Call:
    """One Generate call's span and what its metrics record and log line need."""

    def __init__(self, request: engine_pb2.GenerateRequest, model: str, started_s: float,
                 span: Span):
        self.request_id = request.request_id or "-"
        self.operation = "chat" if request.WhichOneof("input") == "chat" else "text_completion"
        self.model = model
        self.started_s = started_s
        self.span = span
        self.trace_id = f"{span.get_span_context().trace_id:032x}"
        self.prompt_tokens = 0
        self.finished: Finished | None = None
        self.error_type: str | None = None

    def end(self, metrics: GenAIMetrics, engine_id: str) -> None:
        duration_s = time.perf_counter() - self.started_s
        f = self.finished
        s = f.stats if f else RequestStats(prompt_tokens=self.prompt_tokens)
        if f is not None and f.reason == "abort":
            self.error_type = self.error_type or "aborted"
        ttft_s = s.ttft_ms / 1e3 if f is not None and s.completion_tokens else None
        metrics.record_request(self.model, duration_s, time_to_first_token_s=ttft_s,
                               input_tokens=s.prompt_tokens, output_tokens=s.completion_tokens,
                               error_type=self.error_type, operation=self.operation)
        reason = f.reason if f else "no answer"
        self.span.set_attributes({
            "gen_ai.operation.name": self.operation, "gen_ai.request.model": self.model,
            "gen_ai.response.finish_reasons": [reason], "strata.request_id": self.request_id,
            "strata.engine_id": engine_id, "gen_ai.usage.input_tokens": s.prompt_tokens,
            "gen_ai.usage.output_tokens": s.completion_tokens,
            "strata.cache.hit_rate": s.hit_rate, "strata.cache.spill_ratio": s.spill_ratio})
        if self.error_type:
            self.span.set_attribute("error.type", self.error_type)
            self.span.set_status(StatusCode.ERROR)
        self.span.end()
        log.info("request %s %s (trace %s): %d prompt + %d completion tokens in %.0f ms%s",
                 self.request_id, reason, self.trace_id, s.prompt_tokens, s.completion_tokens,
                 duration_s * 1e3, f", {self.error_type}" if self.error_type else "",
                 extra={"request_id": self.request_id, "trace_id": self.trace_id})


def _spec_instruments(meter: Meter, engine: Engine) -> None:
    """Speculative decoding on the engine's metrics endpoint: draft tokens proposed and
    accepted (strata.spec.draft_tokens, by strata.spec.outcome) and their ratio; nothing while
    speculation is off. Read from the loop thread's plain lifetime ints."""
    totals = engine.totals

    def tokens(_: CallbackOptions) -> Iterable[Observation]:
        if engine.draft_source is None:
            return []
        return [Observation(totals.drafts_proposed, {"strata.spec.outcome": "proposed"}),
                Observation(totals.drafts_accepted, {"strata.spec.outcome": "accepted"})]

    def rate(_: CallbackOptions) -> Iterable[Observation]:
        if engine.draft_source is None:
            return []
        return [Observation(totals.draft_acceptance_rate,
                            {"strata.spec.method": engine.draft_source.method})]

    meter.create_observable_counter("strata.spec.draft_tokens", [tokens], unit="{token}",
                                    description="Draft tokens proposed / accepted")
    meter.create_observable_gauge("strata.spec.acceptance_rate", [rate], unit="1",
                                  description="Accepted / proposed draft tokens, lifetime")


def _error_type(exc: BaseException) -> str:
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return "cancelled"
    return type(exc).__name__


def kv_usage(engine: Engine) -> float:
    """Share of the paged KV cache's blocks the engine's scheduler has handed out."""
    blocks = engine.scheduler.blocks
    return 1.0 - blocks.num_free_blocks / blocks.num_blocks


class StatusSource:
    """Builds EngineStatus from the engine, its runner and the applied plan."""

    def __init__(self, engine: Engine, engine_id: str, model_name: str, device: str):
        self.engine = engine
        self.engine_id = engine_id
        self.model_name = model_name
        self.device = device
        self.plan_version = 0
        self.plan_source = "layer-order"

    def status(self) -> engine_pb2.EngineStatus:
        engine, runner, totals = self.engine, self.engine.runner, self.engine.totals
        size = runner.cache_size  # type: ignore[attr-defined]
        return engine_pb2.EngineStatus(
            engine_id=self.engine_id, model=self.model_name, ready=True,
            running=engine.num_running, waiting=engine.num_waiting,
            context_window=engine.context_window, device=self.device,
            requests_finished=totals.requests_finished, tokens_generated=totals.tokens_generated,
            kv_blocks_total=engine.scheduler.blocks.num_blocks,
            kv_blocks_free=engine.scheduler.blocks.num_free_blocks,
            max_running=engine.scheduler.max_running,
            spec=engine_pb2.SpecStatus(
                method=engine.draft_source.method if engine.draft_source else "",
                spec_tokens=engine.spec_tokens, drafts_proposed=totals.drafts_proposed,
                drafts_accepted=totals.drafts_accepted,
                acceptance_rate=totals.draft_acceptance_rate, verify_steps=totals.verify_steps,
                rejected_lookups=totals.rejected_lookups, draft_lookups=totals.draft_lookups),
            cache=engine_pb2.CacheStatus(
                slots=size.slots, total_pairs=size.total_pairs, coverage=size.coverage,
                slot_bytes=size.slot_bytes, device_memory_bytes=size.limit_bytes,
                reserved_bytes=size.reserved_bytes, weight_bytes=size.weight_bytes,
                kv_bytes=size.kv_bytes, draft_bytes=size.draft_head_bytes,
                plan_version=self.plan_version,
                plan_source=self.plan_source, **_cache_policy_status(runner)))


def _cache_policy_status(runner: object) -> dict:
    """Policy, placement and lifetime counters of the runner's expert cache (read from another
    thread than the loop's: copies)."""
    cache = getattr(runner, "cache", None)
    if cache is None:  # a test double without an expert cache
        return {}
    residency = cache.residency
    cost = cache.placer.cost
    return dict(
        policy=residency.spec.name, pinned_slots=residency.num_pinned,
        dynamic_slots=residency.num_dynamic, placement=cache.placer.mode,
        link_gb_s=runner.link.bytes_per_s / 1e9,  # type: ignore[attr-defined]
        host_expert_tokens_s=cost.host.tokens_per_s if cost else 0.0, prefetch=cache.prefetch,
        decode=counters.to_proto(cache.decode.copy()),
        prefill=counters.to_proto(cache.prefill.copy()), evictions=residency.evictions,
        distinct_pairs_routed=cache.distinct_pairs_routed, layer_steps=cache.layer_steps)


async def start_server(engine: Engine, status: StatusSource, host: str, port: int, *,
                       meter_provider: MeterProvider | None = None,
                       tracer_provider: TracerProvider | None = None,
                       first_token_grace_s: float = 0.0
                       ) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Bind the Engine and health services (NOT_SERVING until `set_serving`); returns
    (server, bound port, health servicer). Request metrics and spans go to the providers;
    `first_token_grace_s`: see Outbox."""
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServicer_to_server(
        EngineServicer(engine, status, meter_provider=meter_provider,
                       tracer_provider=tracer_provider,
                       first_token_grace_s=first_token_grace_s), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind the engine's gRPC port {host}:{port}; is another engine "
                      "running there? choose another with --port / STRATA_ENGINE_PORT")
    await server.start()
    await set_serving(health_servicer, False)
    return server, bound, health_servicer


async def set_serving(health_servicer: health.aio.HealthServicer, serving: bool) -> None:
    state = (health_pb2.HealthCheckResponse.SERVING if serving
             else health_pb2.HealthCheckResponse.NOT_SERVING)
    for service in ("", "strata.v1.Engine"):
        await health_servicer.set(service, state)
