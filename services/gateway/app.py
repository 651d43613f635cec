"""`init_app(config)`: the gateway's aiohttp application, the entry point for tests and `run()`.

Telemetry: `init_app(config, meter_provider=..., tracer_provider=...)` records the request
metrics (GenAI conventions) and server spans there; without them the app makes its own: spans
export over OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set, metrics are recorded but not exported.
`clock` is the request path's monotonic clock (admission, durations, deadlines); tests pass a
fake one to measure durations they chose.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from aiohttp import web
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider

from services.common.genai_metrics import GenAIMetrics
from services.common.registry import EngineRegistry, RegistryUnavailable
from services.common.telemetry import setup_tracing
from services.gateway import (
    conversations,
    handlers,
    health,
    openapi,
    response_routes,
    tokenize,
)
from services.gateway.admission import Admission, RejectionLog
from services.gateway.background import BackgroundRuns
from services.gateway.config import GatewayConfig
from services.gateway.engine_client import EnginePool
from services.gateway.ledger import Ledger, Limits, LocalLedger, SharedLedger
from services.gateway.middleware import (
    ApiKeys,
    auth_middleware,
    error_middleware,
    limits_middleware,
    shed_middleware,
)
from services.gateway.response_store import LocalResponseStore, RedisResponseStore
from services.gateway.state import (
    ADMISSION,
    BACKGROUND,
    CLOCK,
    CONFIG,
    METRICS,
    POOL,
    REJECTIONS,
    RESPONSE_STORE,
    TRACER,
)

log = logging.getLogger("strata.gateway")

REGISTRY = web.AppKey("registry", EngineRegistry)


def init_app(config: GatewayConfig, *, meter_provider: MeterProvider | None = None,
             tracer_provider: TracerProvider | None = None,
             clock: Callable[[], float] = time.monotonic) -> web.Application:
    keys = ApiKeys(config.key_hashes)
    app = web.Application(middlewares=[shed_middleware, error_middleware, limits_middleware,
                                       auth_middleware(keys)],
                          client_max_size=config.max_body_bytes)
    limits = Limits(config.max_inflight, config.max_queue, config.max_queued_tokens)
    ledger: Ledger = (SharedLedger(config.redis_url, limits, lease_ttl_s=config.lease_ttl_s,
                                   retry_s=config.redis_retry_s, timeout_s=config.redis_timeout_s)
                      if config.redis_url else LocalLedger(limits))
    admission = Admission(ledger, config.engine_addrs, no_engine_retry_s=config.health_interval_s,
                          initially_ready=False, poll_s=config.queue_poll_s, clock=clock)
    app[CONFIG] = config
    app[CLOCK] = clock
    app[ADMISSION] = admission
    app[POOL] = EnginePool(config.engine_addrs, probe_timeout_s=config.engine_timeout_s,
                           on_ready_change=admission.set_ready,
                           on_removed=admission.remove_engine,
                           breaker_threshold=config.breaker_threshold,
                           breaker_cooldown_s=config.breaker_cooldown_s)
    local = LocalResponseStore(config.responses_ttl_s, config.responses_max_bytes, clock=clock)
    app[RESPONSE_STORE] = (RedisResponseStore(config.redis_url, config.responses_ttl_s, local,
                                              timeout_s=config.redis_timeout_s)
                           if config.redis_url else local)
    app[BACKGROUND] = BackgroundRuns(app[RESPONSE_STORE])
    app[health.DEEP] = health.DeepCheck()
    _telemetry(app, meter_provider, tracer_provider)
    if config.redis_url:
        app[REGISTRY] = EngineRegistry(config.redis_url, timeout_s=config.redis_timeout_s)
    app.cleanup_ctx.append(_limits)
    app.cleanup_ctx.append(_response_store)
    app.cleanup_ctx.append(_engines)
    app.cleanup_ctx.append(_background)  # cleaned up first: its runs need the rest
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_post("/v1/responses", handlers.responses)
    app.router.add_post("/v1/responses/input_tokens", tokenize.count_input_tokens)
    app.router.add_get("/v1/responses/{response_id}", response_routes.retrieve)
    app.router.add_delete("/v1/responses/{response_id}", response_routes.delete)
    app.router.add_post("/v1/responses/{response_id}/cancel", response_routes.cancel)
    app.router.add_get("/v1/responses/{response_id}/input_items", response_routes.input_items)
    app.router.add_post("/v1/conversations", conversations.create)
    app.router.add_get("/v1/conversations/{conversation_id}", conversations.retrieve)
    app.router.add_post("/v1/conversations/{conversation_id}", conversations.update)
    app.router.add_delete("/v1/conversations/{conversation_id}", conversations.delete)
    app.router.add_post("/v1/conversations/{conversation_id}/items", conversations.add_items)
    app.router.add_get("/v1/conversations/{conversation_id}/items", conversations.list_items)
    app.router.add_get("/v1/conversations/{conversation_id}/items/{item_id}",
                       conversations.get_item)
    app.router.add_delete("/v1/conversations/{conversation_id}/items/{item_id}",
                          conversations.delete_item)
    app.router.add_get("/v1/models", health.models)
    app.router.add_get("/v1/models/{model:.+}", health.model)
    app.router.add_post("/tokenize", tokenize.tokenize)
    app.router.add_post("/detokenize", tokenize.detokenize)
    app.router.add_get("/tokenizer_info", tokenize.tokenizer_info)
    app.router.add_get("/livez", health.livez)
    app.router.add_get("/health/live", health.livez)
    app.router.add_get("/readyz", health.readyz)
    app.router.add_get("/health", health.health)
    app.router.add_get("/openapi.json", openapi.handler)
    if keys.enabled:
        log.info("API keys required (%d accepted)", len(config.key_hashes))
    return app


def _telemetry(app: web.Application, meter_provider: MeterProvider | None,
               tracer_provider: TracerProvider | None) -> None:
    owned = []
    if meter_provider is None:
        meter_provider = MeterProvider()  # no reader: recorded, not exported
        owned.append(meter_provider)
    if tracer_provider is None:
        tracer_provider = setup_tracing("strata-gateway")
        owned.append(tracer_provider)
    admission = app[ADMISSION]
    metrics = GenAIMetrics(meter_provider.get_meter("strata.gateway"))
    metrics.set_load_source(lambda: (admission.num_inflight, admission.num_waiting, None))
    app[METRICS] = metrics
    app[REJECTIONS] = RejectionLog()
    app[TRACER] = tracer_provider.get_tracer("strata.gateway")

    async def shutdown(_: web.Application) -> AsyncIterator[None]:
        yield
        for provider in owned:
            provider.shutdown()

    app.cleanup_ctx.append(shutdown)


async def _limits(app: web.Application) -> AsyncIterator[None]:
    ledger = app[ADMISSION].ledger
    if isinstance(ledger, SharedLedger):
        await ledger.start()
    try:
        yield
    finally:
        await app[ADMISSION].close()
        if isinstance(ledger, SharedLedger):
            await ledger.close()


async def _response_store(app: web.Application) -> AsyncIterator[None]:
    yield
    await app[RESPONSE_STORE].close()


async def _background(app: web.Application) -> AsyncIterator[None]:
    yield
    await app[BACKGROUND].close()


async def _engines(app: web.Application) -> AsyncIterator[None]:
    """Open the engine channels, probe them once, keep probing (and reading the registry)."""
    config, pool = app[CONFIG], app[POOL]
    await pool.start()
    registry = app.get(REGISTRY)
    if registry is not None:
        await _read_registry(pool, registry, quiet=False)
    statuses = await pool.probe_all()
    for address, status in statuses.items():
        if status is None:
            log.warning("engine %s does not answer GetStatus yet; requests get 503 no_engine "
                        "until it does (retrying every %.1f s)", address, config.health_interval_s)
    log.info("gateway: %d engine(s), %d ready; caps %d in flight per engine, %d queued "
             "(%d prompt tokens); limits %s", len(statuses),
             sum(bool(s and s.ready) for s in statuses.values()), config.max_inflight,
             config.max_queue, config.max_queued_tokens, app[ADMISSION].ledger.mode)
    task = asyncio.create_task(_probe_forever(pool, registry, config.health_interval_s))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await pool.close()
        if registry is not None:
            await registry.close()


async def _read_registry(pool: EnginePool, registry: EngineRegistry, *, quiet: bool) -> None:
    """Adopt the registry's engines; keep the last known list while Redis is away."""
    try:
        found = await registry.engines()
    except RegistryUnavailable as exc:
        if not quiet:
            log.warning("%s; using the engines known so far", exc)
        return
    await pool.sync_registry([e.address for e in found])


async def _probe_forever(pool: EnginePool, registry: EngineRegistry | None,
                         interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            if registry is not None:
                await _read_registry(pool, registry, quiet=True)
            await pool.probe_all()
        except Exception:  # a probe bug must not stop probing
            log.exception("engine probe failed unexpectedly; retrying in %.1f s", interval_s)


async def drain(app: web.Application, timeout_s: float) -> bool:
    """SIGTERM: fail readiness and refuse new requests at once, let the admitted ones finish
    within `timeout_s`. True if everything finished in time."""
    admission = app[ADMISSION]
    admission.drain()
    log.info("draining: /readyz answers 503, new requests get 503 draining; waiting up to "
             "%.0f s for %d running and %d queued requests", timeout_s, admission.num_inflight,
             admission.num_waiting)
    finished = await admission.wait_idle(timeout_s)
    if finished:
        log.info("drained: every admitted request finished")
    else:
        log.warning("drain timeout: %d running and %d queued requests are cut off",
                    admission.num_inflight, admission.num_waiting)
    return finished
