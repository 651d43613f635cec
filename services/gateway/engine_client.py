"""gRPC edge to the engines: proto messages in, frozen dataclasses out.

`EnginePool` holds one channel per engine address (static `--engine` addresses plus those found in
the registry), probes `GetStatus` to learn which engines are ready (and which model they serve),
keeps a circuit breaker per engine, and opens `Generate` calls with a deadline and the request id
and trace context in metadata. A call is an async context manager: leaving it early (client
gone, error) cancels the RPC so the engine stops working on it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any

import grpc

from services.common import counters
from services.common.counters import CacheCounters, DecodeFigures
from services.common.pb.strata.v1 import engine_pb2, engine_pb2_grpc
from services.common.rpc_errors import CODE_KEY, PARAM_KEY
from services.gateway.breaker import CircuitBreaker
from services.gateway.errors import EngineError
from services.gateway.schemas import GenerateInput

log = logging.getLogger("strata.gateway.engine")

_DRAIN_TIMEOUT_S = 5.0
_draining: set[asyncio.Task[None]] = set()  # strong references until the status arrives
_closing: set[asyncio.Task[None]] = set()  # channels of engines that left, closing gracefully

_FINISH_REASONS = {
    engine_pb2.FINISH_REASON_STOP: "stop",
    engine_pb2.FINISH_REASON_LENGTH: "length",
    engine_pb2.FINISH_REASON_ABORT: "abort",
}


@dataclass(frozen=True)
class EngineStatus:
    engine_id: str
    model: str
    ready: bool
    running: int
    waiting: int
    context_window: int


@dataclass(frozen=True)
class Started:
    prompt_tokens: int
    context_window: int
    engine_id: str
    tool_call_format: str = ""  # set when the request has tools


@dataclass(frozen=True)
class TopLogprob:
    token: str
    logprob: float
    token_bytes: bytes


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float | None  # None: an echoed prompt's first token (nothing before it)
    token_bytes: bytes
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class Delta:
    """One engine step's output for a request (one message), or several merged."""

    text: str
    num_tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()

    @staticmethod
    def join(deltas: Sequence[Delta]) -> Delta:
        if len(deltas) == 1:
            return deltas[0]
        return Delta("".join(d.text for d in deltas), sum(d.num_tokens for d in deltas),
                     tuple(lp for d in deltas for lp in d.logprobs))


@dataclass(frozen=True)
class RequestStats(DecodeFigures):
    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    ttft_ms: float = 0.0
    decode_tok_s: float = 0.0
    decode: CacheCounters = field(default_factory=CacheCounters)  # its decode tokens' cache
    drafts_proposed: int = 0  # speculative decoding
    drafts_accepted: int = 0
    draft_acceptance_rate: float = 0.0


@dataclass(frozen=True)
class Echo:
    """The prompt (GenerateInput.echo), before the first Delta: its text, and with logprobs one
    entry per prompt token, the first without a logprob."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" | "length" | "abort"
    stats: RequestStats
    error: str = ""


Event = Started | Echo | Delta | Finished


def _stats(pb: engine_pb2.RequestStats) -> RequestStats:
    return RequestStats(
        prompt_tokens=pb.prompt_tokens, reused_prompt_tokens=pb.reused_prompt_tokens,
        completion_tokens=pb.completion_tokens, queue_ms=pb.queue_ms, prefill_ms=pb.prefill_ms,
        decode_ms=pb.decode_ms, ttft_ms=pb.ttft_ms, decode_tok_s=pb.decode_tok_s,
        decode=counters.from_proto(pb.decode), drafts_proposed=pb.drafts_proposed,
        drafts_accepted=pb.drafts_accepted, draft_acceptance_rate=pb.draft_acceptance_rate)


def _events(pb: engine_pb2.GenerateEvent) -> list[Event]:
    """A message's events in order: Started, the echo, the tokens, Finished (each where
    present)."""
    events: list[Event] = []
    if pb.HasField("started"):
        events.append(Started(pb.started.prompt_tokens, pb.started.context_window,
                              pb.started.engine_id, pb.started.tool_call_format))
    if pb.HasField("echo"):
        logprobs = [_logprob(lp) for lp in pb.echo.logprobs]
        if logprobs:
            logprobs[0] = replace(logprobs[0], logprob=None, top=())
        events.append(Echo(pb.echo.text, tuple(logprobs)))
    if pb.HasField("delta"):
        events.append(Delta(pb.delta.text, len(pb.delta.token_ids),
                            tuple(_logprob(lp) for lp in pb.delta.logprobs)))
    if pb.HasField("finished"):
        events.append(Finished(_FINISH_REASONS.get(pb.finished.reason, "abort"),
                               _stats(pb.finished.stats), pb.finished.error))
    if not events:
        raise EngineError("INTERNAL", "an empty event message from the engine", "?")
    return events


def _bytes(token: str, raw: bytes) -> bytes:
    return raw or token.encode()


def _logprob(pb: engine_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(pb.token, pb.logprob, _bytes(pb.token, pb.bytes),
                        tuple(TopLogprob(t.token, t.logprob, _bytes(t.token, t.bytes))
                              for t in pb.top))


def _request(spec: GenerateInput, request_id: str, stream_interval_ms: float,
             following: int = 0) -> engine_pb2.GenerateRequest:
    s = spec.sampling
    sampling = engine_pb2.SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens,
        stop=list(s.stop), logprobs=s.logprobs, top_logprobs=s.top_logprobs,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty, logit_bias=dict(s.logit_bias), min_p=s.min_p,
        min_tokens=s.min_tokens, ignore_eos=s.ignore_eos, stop_token_ids=list(s.stop_token_ids),
        echo=spec.echo, echo_only=spec.echo_only)
    if s.seed is not None:
        sampling.seed = s.seed
    request = engine_pb2.GenerateRequest(request_id=request_id, sampling=sampling,
                                         stream_interval_ms=stream_interval_ms,
                                         following=following)
    if spec.is_chat:
        request.chat.CopyFrom(chat_input(spec))
    elif isinstance(spec.prompt, tuple):
        request.prompt_token_ids.ids.extend(spec.prompt)
    else:
        request.prompt = spec.prompt or ""
        request.suffix = spec.suffix
    if (c := spec.constraint) is not None:
        if c.kind == "json_object":
            request.constraint.json_object = True
        else:
            setattr(request.constraint, c.kind, c.text)
    return request


def chat_input(spec: GenerateInput) -> engine_pb2.ChatInput:
    """A chat request's messages and tools, as the engine takes them (Generate, Tokenize)."""
    chat = engine_pb2.ChatInput(messages=[engine_pb2.ChatMessage(
        role=m.role, content=m.content, tool_call_id=m.tool_call_id, name=m.name,
        reasoning_content=m.reasoning_content,
        tool_calls=[engine_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments)
                    for c in m.tool_calls]) for m in spec.messages])
    if (tools := spec.tools) is not None:
        chat.tools_json = tools.tools_json
        chat.tool_choice = tools.choice
        chat.parallel_tool_calls = tools.parallel
        chat.allowed_tools.extend(tools.allowed)
    chat.template_kwargs_json = spec.template_kwargs_json
    chat.reasoning_effort = spec.reasoning_effort
    return chat


# A channel to an engine that went away retries its connection at most a second apart (gRPC's
# default backoff grows to 120 s): the probes see a restarted engine as soon as it listens.
_CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 200),
                    ("grpc.min_reconnect_backoff_ms", 200),
                    ("grpc.max_reconnect_backoff_ms", 1000))

# gRPC codes that say the engine (not the request) is in trouble: they count against its breaker.
_ENGINE_FAULTS = frozenset({"UNAVAILABLE", "INTERNAL", "UNKNOWN", "DATA_LOSS"})


class GenerateCall:
    """One Generate RPC. `async with` it; iterate events; exit cancels it if unfinished."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, engine: str, pool: EnginePool) -> None:
        self._call = call
        self.engine = engine
        self._pool = pool
        self.finished = False
        self._unread: collections.deque[Event] = collections.deque()  # the last message's rest

    async def __aenter__(self) -> GenerateCall:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._call.done():
            return
        if self.finished and exc_type is None:
            # Only the trailing OK status is left: let it arrive (off the response path) rather
            # than cancel a request the engine has already finished.
            task = asyncio.create_task(self._drain())
            _draining.add(task)
            task.add_done_callback(_draining.discard)
        else:
            self._call.cancel()

    async def _drain(self) -> None:
        with contextlib.suppress(TimeoutError, grpc.aio.AioRpcError):
            await asyncio.wait_for(self._call.code(), timeout=_DRAIN_TIMEOUT_S)
        if not self._call.done():
            self._call.cancel()

    async def next_event(self) -> Event | None:
        """The next event, or None once the stream ends. gRPC errors raise EngineError."""
        if not self._unread:
            try:
                message = await self._call.read()
            except grpc.aio.AioRpcError as exc:
                raise self._error(exc) from None
            if message is grpc.aio.EOF:
                return None
            self._unread.extend(_events(message))
        event = self._unread.popleft()
        if isinstance(event, Finished):
            self.finished = True
            self._pool.record_success(self.engine)
        return event

    async def events(self) -> AsyncIterator[Event]:
        while (event := await self.next_event()) is not None:
            yield event

    def _error(self, exc: grpc.aio.AioRpcError) -> EngineError:
        return self._pool.error(self.engine, exc)


class EnginePool:
    """Channels to the engines, their last known status, breakers, and the readiness callback."""

    def __init__(self, addresses: Sequence[str], *, probe_timeout_s: float,
                 on_ready_change: Callable[[str, bool], None],
                 on_removed: Callable[[str], None] = lambda address: None,
                 breaker_threshold: int = 3, breaker_cooldown_s: float = 5.0) -> None:
        self.static_addresses = tuple(addresses)
        self._probe_timeout_s = probe_timeout_s
        self._on_ready_change = on_ready_change
        self._on_removed = on_removed
        self._breaker_args = (breaker_threshold, breaker_cooldown_s)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, engine_pb2_grpc.EngineStub] = {}
        self.statuses: dict[str, EngineStatus | None] = {}
        self.breakers: dict[str, CircuitBreaker] = {}
        self.discovered: set[str] = set()  # addresses found in the registry
        self._reported: dict[str, bool] = {}  # readiness last told to on_ready_change

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(self.statuses)

    async def start(self) -> None:
        for address in self.static_addresses:
            self.add(address)

    def add(self, address: str) -> None:
        if address in self._channels:
            return
        channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        self._channels[address] = channel
        self._stubs[address] = engine_pb2_grpc.EngineStub(channel)
        self.statuses[address] = None
        self.breakers[address] = CircuitBreaker(*self._breaker_args)

    async def remove(self, address: str) -> None:
        """Forget an engine that left the registry (calls already open keep their channel)."""
        self.statuses[address] = None
        self._sync_ready(address)
        self._reported.pop(address, None)
        self.statuses.pop(address, None)
        self.breakers.pop(address, None)
        self._stubs.pop(address, None)
        self.discovered.discard(address)
        self._on_removed(address)
        channel = self._channels.pop(address, None)
        if channel is not None:
            task = asyncio.create_task(channel.close(grace=_DRAIN_TIMEOUT_S))
            _closing.add(task)
            task.add_done_callback(_closing.discard)

    async def sync_registry(self, registered: Sequence[str]) -> None:
        """Make the discovered engines exactly `registered` (static ones always stay)."""
        for address in registered:
            if address not in self.statuses:
                log.info("engine %s found in the registry", address)
                self.add(address)
                self.discovered.add(address)
        for address in list(self.discovered):
            if address not in registered and address not in self.static_addresses:
                log.info("engine %s left the registry; no new requests go there", address)
                await self.remove(address)

    async def close(self) -> None:
        await asyncio.gather(*(c.close(grace=None) for c in self._channels.values()))
        self._channels.clear()
        self._stubs.clear()

    @property
    def models(self) -> list[str]:
        """Models served by ready engines, from the last probes (the cache)."""
        return sorted({s.model for a, s in self.statuses.items()
                       if s is not None and self._is_ready(a)})

    async def probe(self, address: str) -> EngineStatus | None:
        """GetStatus on one engine; records and returns its status, None when it does not answer.
        An open breaker stops the probes too (an engine that answers them but fails its
        requests gets one trial a cooldown), except for an engine that was unreachable: one
        that comes back (a restart, which may take minutes for a large model) is ready at the
        next probe, not after a cooldown doubled by every trial that found it still loading."""
        breaker = self.breakers.get(address)
        stub = self._stubs.get(address)
        if breaker is None or stub is None:
            return None
        status: EngineStatus | None = None
        if breaker.allows() or self.statuses.get(address) is None:
            try:
                pb = await stub.GetStatus(engine_pb2.GetStatusRequest(),
                                          timeout=self._probe_timeout_s)
                status = EngineStatus(pb.engine_id, pb.model, pb.ready, pb.running, pb.waiting,
                                      pb.context_window)
                breaker.record_success()
            except grpc.aio.AioRpcError as exc:
                last = self.statuses.get(address)
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and last is not None:
                    # Slow, not gone (a loaded host): it keeps its place until the breaker
                    # opens on consecutive failures; an engine that is down answers UNAVAILABLE.
                    status = last
                    log.warning("engine %s answered no GetStatus within %.1f s; it stays in "
                                "rotation unless %d probes or calls in a row fail", address,
                                self._probe_timeout_s, breaker.threshold)
                elif last is not None:
                    log.warning("engine %s stopped answering GetStatus (%s: %s); routing around "
                                "it until it answers again", address, exc.code().name,
                                exc.details())
                if breaker.record_failure():
                    self._log_open(address, breaker)
        if address not in self.statuses:  # removed while the probe ran
            return None
        self.statuses[address] = status
        if self._sync_ready(address) and status is not None:
            log.info("engine %s ready: model %s, context window %d tokens", address,
                     status.model, status.context_window)
        return status

    async def probe_all(self) -> dict[str, EngineStatus | None]:
        addresses = self.addresses
        results = await asyncio.gather(*(self.probe(a) for a in addresses))
        return dict(zip(addresses, results, strict=True))

    def record_success(self, address: str) -> None:
        if (breaker := self.breakers.get(address)) is not None:
            breaker.record_success()

    def record_failure(self, address: str, code: str, *, unreachable: bool) -> None:
        """A Generate call failed with an engine fault. UNAVAILABLE: stop routing there until a
        probe succeeds; any fault: count it, and open the breaker after too many in a row."""
        breaker = self.breakers.get(address)
        if breaker is None:
            return
        if breaker.record_failure():
            self._log_open(address, breaker)
        if unreachable and self.statuses.get(address) is not None:
            log.warning("engine %s is unreachable (UNAVAILABLE on Generate); routing around it",
                        address)
            self.statuses[address] = None
        self._sync_ready(address)

    def error(self, address: str, exc: grpc.aio.AioRpcError) -> EngineError:
        """A failed call's EngineError (the field at fault from the trailers, where the engine
        named one); an engine fault counts against the engine's breaker."""
        code = exc.code().name
        if code in _ENGINE_FAULTS:
            self.record_failure(address, code, unreachable=code == "UNAVAILABLE")
        trailer = dict(exc.trailing_metadata() or ())
        return EngineError(code, exc.details() or "", address, trailer.get(PARAM_KEY),
                           trailer.get(CODE_KEY))

    async def tokenizer(self, address: str, method: str, request: Any, timeout_s: float) -> Any:
        """One of the engine's tokenizer RPCs (Tokenize, Detokenize, GetTokenizerInfo)."""
        try:
            return await getattr(self._stubs[address], method)(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self.error(address, exc) from None

    def generate(self, address: str, spec: GenerateInput, request_id: str, *,
                 metadata: Sequence[tuple[str, str]] = (),
                 timeout_s: float | None = None,
                 stream_interval_ms: float = 0.0, following: int = 0) -> GenerateCall:
        """`following`: requests this gateway forwards to the engine right after this one
        (GenerateRequest.following)."""
        call = self._stubs[address].Generate(
            _request(spec, request_id, stream_interval_ms, following), timeout=timeout_s,
            metadata=(("x-request-id", request_id), *metadata))
        return GenerateCall(call, address, self)

    def _sync_ready(self, address: str) -> bool:
        """Tell on_ready_change if readiness changed; True when it just became ready."""
        ready = self._is_ready(address)
        if self._reported.get(address, False) == ready:
            return False
        self._reported[address] = ready
        self._on_ready_change(address, ready)
        return ready

    def _is_ready(self, address: str) -> bool:
        status = self.statuses.get(address)
        breaker = self.breakers.get(address)
        return (status is not None and status.ready and breaker is not None
                and breaker.allows())

    @staticmethod
    def _log_open(address: str, breaker: CircuitBreaker) -> None:
        log.warning("engine %s: circuit breaker open after %d consecutive failures; no traffic "
                    "for %.1f s, then one trial (sooner if it was unreachable and answers a "
                    "probe again)", address, breaker.failures, breaker.cooldown_s)
