"""Real servers on loopback: a scripted gRPC Engine and the gateway app on free ports."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field, replace

import grpc
import pytest
from aiohttp import web
from openai import AsyncOpenAI

from services.common.pb.strata.v1 import counters_pb2, engine_pb2, engine_pb2_grpc
from services.common.redis_server import EmbeddedRedis
from services.gateway.app import init_app
from services.gateway.config import GatewayConfig

MODEL = "tiny-moe"


@dataclass
class ScriptedEngine(engine_pb2_grpc.EngineServicer):
    """An Engine whose behaviour each test sets: tokens, pacing, failures. Records what it saw."""

    tokens: list[str] = field(default_factory=lambda: ["Hello", ",", " world", "!"])
    token_delay_s: float = 0.0
    context_window: int = 32  # prompts are counted in whitespace-separated words
    fail_after: int | None = None  # abort the RPC with INTERNAL after this many tokens
    abort_after: int | None = None  # send Finished(ABORT) after this many tokens
    status_code: grpc.StatusCode | None = None  # fail Generate with this at once
    ready: bool = True
    status_delay_s: float = 0.0  # GetStatus answers this late (a loaded or hung engine)
    hold: asyncio.Event | None = None  # when set up, tokens wait until the test sets it
    requests: list[engine_pb2.GenerateRequest] = field(default_factory=list)
    metadata: dict[str, dict[str, str]] = field(default_factory=dict)  # request id -> metadata
    deadlines: dict[str, float | None] = field(default_factory=dict)  # request id -> seconds left
    cancelled: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    running: int = 0
    max_running_seen: int = 0
    num_status_calls: int = 0  # GetStatus calls (the gateways' probes)
    tool_call_format: str = ""  # Started.tool_call_format: how the gateway parses tool calls
    # a request's own tokens, where this answers with some (else `tokens`)
    tokens_for: Callable[[engine_pb2.GenerateRequest], list[str] | None] | None = None

    async def GetStatus(self, request, context):
        self.num_status_calls += 1
        if self.status_delay_s:
            await asyncio.sleep(self.status_delay_s)
        return engine_pb2.EngineStatus(engine_id="engine-0", model=MODEL, ready=self.ready,
                                       running=self.running, context_window=self.context_window)

    async def Generate(self, request, context):
        self.requests.append(request)
        rid = request.request_id
        self.metadata[rid] = dict(context.invocation_metadata())
        self.deadlines[rid] = context.time_remaining()
        if self.status_code is not None:
            await context.abort(self.status_code, f"scripted {self.status_code.name}")
        prompt_tokens = _count_tokens(request)
        if prompt_tokens > self.context_window:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"prompt is {prompt_tokens} tokens but the context window is "
                                f"{self.context_window} tokens")
        self.running += 1
        self.max_running_seen = max(self.max_running_seen, self.running)
        try:
            yield engine_pb2.GenerateEvent(started=engine_pb2.Started(
                prompt_tokens=prompt_tokens, context_window=self.context_window,
                engine_id="engine-0", tool_call_format=self.tool_call_format))
            if self.hold is not None:
                await self.hold.wait()
            tokens = (self.tokens_for and self.tokens_for(request)) or self.tokens
            limit = request.sampling.max_tokens or len(tokens)
            emitted = tokens[:limit]
            for i, text in enumerate(emitted):
                if i == self.fail_after:
                    await context.abort(grpc.StatusCode.INTERNAL, "scripted failure mid-stream")
                if i == self.abort_after:
                    yield _finished(engine_pb2.FINISH_REASON_ABORT, prompt_tokens, i, "scripted abort")
                    return
                await asyncio.sleep(self.token_delay_s)
                yield engine_pb2.GenerateEvent(delta=engine_pb2.TokenDelta(
                    text=text, token_ids=[i], logprobs=_logprobs(request.sampling, i, text)))
            reason = (engine_pb2.FINISH_REASON_LENGTH if len(emitted) < len(tokens)
                      else engine_pb2.FINISH_REASON_STOP)
            self.finished.append(rid)
            yield _finished(reason, prompt_tokens, len(emitted))
        except (asyncio.CancelledError, GeneratorExit):
            # The client (the gateway) cancelled the RPC: grpc.aio cancels the task while it
            # awaits, or closes the generator (GeneratorExit) while it is suspended at a yield.
            self.cancelled.append(rid)
            raise
        finally:
            self.running -= 1


    async def Tokenize(self, request, context):
        """One id a whitespace-separated word (and one a chat message), as prompts are
        counted here."""
        if request.WhichOneof("input") == "chat":
            count = sum(len(m.content.split()) + 1 for m in request.chat.messages)
        else:
            count = len(request.text.split())
        return engine_pb2.TokenIds(ids=range(count))


def _logprobs(sampling: engine_pb2.SamplingParams, i: int,
              text: str) -> list[engine_pb2.TokenLogprob]:
    """Token i has logprob -(i+1)/10; its k-th alternative is 'alt{k}' at -(i+1)/10 - k - 1."""
    if not sampling.logprobs:
        return []
    lp = -(i + 1) / 10
    top = [engine_pb2.TopLogprob(token_id=1000 + k, token=f"alt{k}", logprob=lp - k - 1)
           for k in range(sampling.top_logprobs)]
    return [engine_pb2.TokenLogprob(token_id=i, token=text, logprob=lp, top=top)]


def _count_tokens(request: engine_pb2.GenerateRequest) -> int:
    if request.WhichOneof("input") == "prompt":
        return len(request.prompt.split())
    if request.WhichOneof("input") == "prompt_token_ids":
        return len(request.prompt_token_ids.ids)
    return sum(len(m.content.split()) + 1 for m in request.chat.messages)


def _finished(reason: int, prompt_tokens: int, completion_tokens: int,
              error: str = "") -> engine_pb2.GenerateEvent:
    stats = engine_pb2.RequestStats(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, queue_ms=1.5,
        ttft_ms=2.0, decode_tok_s=123.0,
        decode=counters_pb2.CacheCounters(lookups=100, hits=75, misses_host=25),
        drafts_proposed=8, drafts_accepted=6, draft_acceptance_rate=0.75)
    return engine_pb2.GenerateEvent(finished=engine_pb2.Finished(reason=reason, stats=stats,
                                                                 error=error))


async def start_engine(servicer: ScriptedEngine, port: int = 0) -> tuple[grpc.aio.Server, int]:
    """A real gRPC server on loopback (port 0: a free one); restartable on the same port."""
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


@pytest.fixture
async def engine() -> AsyncIterator[tuple[ScriptedEngine, str]]:
    servicer = ScriptedEngine()
    server, port = await start_engine(servicer)
    yield servicer, f"127.0.0.1:{port}"
    await server.stop(grace=None)


@pytest.fixture
def redis_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


GatewayFactory = Callable[..., Awaitable[str]]


@pytest.fixture
async def make_gateway(engine) -> AsyncIterator[GatewayFactory]:
    """Start the gateway on a free port (real AppRunner, as `run()` does); returns its base URL.
    `clock`: the gateway's monotonic clock (a test's fake one makes its durations exact)."""
    runners: list[web.AppRunner] = []
    _, address = engine

    async def start(clock: Callable[[], float] = time.monotonic, **overrides) -> str:
        config = replace(GatewayConfig(host="127.0.0.1", port=0, engine_addrs=(address,),
                                       health_interval_s=0.2, engine_timeout_s=1.0,
                                       breaker_cooldown_s=0.3, redis_retry_s=0.2), **overrides)
        runner = web.AppRunner(init_app(config, clock=clock), handler_cancellation=True)
        await runner.setup()
        runners.append(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        return f"http://{host}:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def gateway(make_gateway) -> str:
    return await make_gateway()


@pytest.fixture
async def client(gateway) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A tiny random checkpoint for the tests that run the real engine behind the gateway."""
    from services.engine.model.demo import write_demo_checkpoint

    return write_demo_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "tiny-gateway", seed=1, num_hidden_layers=2,
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=512, vocab_size=320)


@contextlib.asynccontextmanager
async def real_engine(checkpoint, engine_id: str, **engine_kw
                      ) -> AsyncIterator[tuple[str, object, str]]:
    """(address, engine core, model name): the real engine core on `checkpoint` (Engine's
    keyword arguments: engine_kw) behind its gRPC server on a loopback port, in this process."""
    from services.engine.core import Engine
    from services.engine.runner import ModelRunner
    from services.engine.server import StatusSource, set_serving, start_server

    runner = ModelRunner(checkpoint, cache_slots=8, reserved_bytes=0)
    engine = Engine(runner, **engine_kw)
    server, port, health = await start_server(
        engine, StatusSource(engine, engine_id, runner.model_name, "cpu"), "127.0.0.1", 0)
    engine.start()
    await set_serving(health, True)
    try:
        yield f"127.0.0.1:{port}", engine, runner.model_name
    finally:
        await server.stop(grace=None)
        engine.stop()
