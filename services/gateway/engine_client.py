"""gRPC edge to the engines: proto messages in, frozen dataclasses out.

`EnginePool` holds one channel per engine address, probes `GetStatus` to learn which engines are
ready (and which model they serve), and opens `Generate` calls. A call is an async context
manager: leaving it early (client gone, error) cancels the RPC so the engine stops working on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType

import grpc

from services.common.pb.strata.v1 import engine_pb2, engine_pb2_grpc
from services.gateway.errors import EngineError
from services.gateway.schemas import GenerateInput

log = logging.getLogger("strata.gateway.engine")

_DRAIN_TIMEOUT_S = 5.0
_draining: set[asyncio.Task[None]] = set()  # strong references until the status arrives

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


@dataclass(frozen=True)
class Delta:
    text: str
    num_tokens: int


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
    hit_rate: float = 0.0
    spill_ratio: float = 0.0


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" | "length" | "abort"
    stats: RequestStats
    error: str = ""


Event = Started | Delta | Finished


def _stats(pb: engine_pb2.RequestStats) -> RequestStats:
    return RequestStats(
        prompt_tokens=pb.prompt_tokens, reused_prompt_tokens=pb.reused_prompt_tokens,
        completion_tokens=pb.completion_tokens, queue_ms=pb.queue_ms, prefill_ms=pb.prefill_ms,
        decode_ms=pb.decode_ms, ttft_ms=pb.ttft_ms, decode_tok_s=pb.decode_tok_s,
        hit_rate=pb.hit_rate, spill_ratio=pb.spill_ratio)


def _event(pb: engine_pb2.GenerateEvent) -> Event:
    kind = pb.WhichOneof("event")
    if kind == "started":
        return Started(pb.started.prompt_tokens, pb.started.context_window, pb.started.engine_id)
    if kind == "delta":
        return Delta(pb.delta.text, len(pb.delta.token_ids))
    if kind == "finished":
        return Finished(_FINISH_REASONS.get(pb.finished.reason, "abort"),
                        _stats(pb.finished.stats), pb.finished.error)
    raise EngineError("INTERNAL", f"unknown event kind {kind!r} from the engine", "?")


def _request(spec: GenerateInput, request_id: str) -> engine_pb2.GenerateRequest:
    s = spec.sampling
    sampling = engine_pb2.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                         max_tokens=s.max_tokens, stop=list(s.stop))
    if s.seed is not None:
        sampling.seed = s.seed
    if spec.is_chat:
        chat = engine_pb2.ChatInput(messages=[engine_pb2.ChatMessage(role=m.role, content=m.content)
                                              for m in spec.messages])
        return engine_pb2.GenerateRequest(request_id=request_id, chat=chat, sampling=sampling)
    return engine_pb2.GenerateRequest(request_id=request_id, prompt=spec.prompt, sampling=sampling)


class GenerateCall:
    """One Generate RPC. `async with` it; iterate events; exit cancels it if unfinished."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, engine: str,
                 on_unavailable: Callable[[str], None]) -> None:
        self._call = call
        self.engine = engine
        self._on_unavailable = on_unavailable
        self.finished = False

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
        try:
            message = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None
        if message is grpc.aio.EOF:
            return None
        event = _event(message)
        if isinstance(event, Finished):
            self.finished = True
        return event

    async def events(self) -> AsyncIterator[Event]:
        while (event := await self.next_event()) is not None:
            yield event

    def _error(self, exc: grpc.aio.AioRpcError) -> EngineError:
        code = exc.code()
        if code == grpc.StatusCode.UNAVAILABLE:
            self._on_unavailable(self.engine)
        return EngineError(code.name, exc.details() or "", self.engine)


class EnginePool:
    """Channels to the engines, their last known status, and the readiness callback."""

    def __init__(self, addresses: Sequence[str], *, probe_timeout_s: float,
                 on_ready_change: Callable[[str, bool], None]) -> None:
        self.addresses = tuple(addresses)
        self._probe_timeout_s = probe_timeout_s
        self._on_ready_change = on_ready_change
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, engine_pb2_grpc.EngineStub] = {}
        self.statuses: dict[str, EngineStatus | None] = dict.fromkeys(self.addresses)

    async def start(self) -> None:
        for address in self.addresses:
            channel = grpc.aio.insecure_channel(address)
            self._channels[address] = channel
            self._stubs[address] = engine_pb2_grpc.EngineStub(channel)

    async def close(self) -> None:
        await asyncio.gather(*(c.close(grace=None) for c in self._channels.values()))
        self._channels.clear()
        self._stubs.clear()

    @property
    def models(self) -> list[str]:
        """Models served by ready engines, from the last probes (the cache)."""
        return sorted({s.model for s in self.statuses.values() if s is not None and s.ready})

    async def probe(self, address: str) -> EngineStatus | None:
        """GetStatus on one engine; records and returns its status, None when it does not answer."""
        try:
            pb = await self._stubs[address].GetStatus(engine_pb2.GetStatusRequest(),
                                                      timeout=self._probe_timeout_s)
            status: EngineStatus | None = EngineStatus(
                pb.engine_id, pb.model, pb.ready, pb.running, pb.waiting, pb.context_window)
        except grpc.aio.AioRpcError as exc:
            if self.statuses.get(address) is not None:
                log.warning("engine %s stopped answering GetStatus (%s: %s); routing around it "
                            "until it answers again", address, exc.code().name, exc.details())
            status = None
        was_ready = self._is_ready(self.statuses.get(address))
        self.statuses[address] = status
        if self._is_ready(status) != was_ready:
            if status is not None and status.ready:
                log.info("engine %s ready: model %s, context window %d tokens", address,
                         status.model, status.context_window)
            self._on_ready_change(address, self._is_ready(status))
        return status

    async def probe_all(self) -> dict[str, EngineStatus | None]:
        results = await asyncio.gather(*(self.probe(a) for a in self.addresses))
        return dict(zip(self.addresses, results, strict=True))

    def mark_unavailable(self, address: str) -> None:
        """A Generate call got UNAVAILABLE: stop routing there until a probe succeeds."""
        if self._is_ready(self.statuses.get(address)):
            log.warning("engine %s is unreachable (UNAVAILABLE on Generate); routing around it",
                        address)
            self.statuses[address] = None
            self._on_ready_change(address, False)

    def generate(self, address: str, spec: GenerateInput, request_id: str) -> GenerateCall:
        call = self._stubs[address].Generate(_request(spec, request_id))
        return GenerateCall(call, address, self.mark_unavailable)

    @staticmethod
    def _is_ready(status: EngineStatus | None) -> bool:
        return status is not None and status.ready
