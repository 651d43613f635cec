"""`init_app(config)`: the gateway's aiohttp application, the entry point for tests and `run()`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from services.gateway import handlers
from services.gateway.admission import Admission
from services.gateway.config import GatewayConfig
from services.gateway.engine_client import EnginePool
from services.gateway.handlers import ADMISSION, CONFIG, POOL

log = logging.getLogger("strata.gateway")


def init_app(config: GatewayConfig) -> web.Application:
    app = web.Application(middlewares=[handlers.error_middleware, handlers.auth_middleware],
                          client_max_size=config.max_body_bytes)
    admission = Admission(config.engine_addrs, config.max_inflight, config.max_queue,
                          no_engine_retry_s=config.health_interval_s, initially_ready=False)
    app[CONFIG] = config
    app[ADMISSION] = admission
    app[POOL] = EnginePool(config.engine_addrs, probe_timeout_s=config.engine_timeout_s,
                           on_ready_change=admission.set_ready)
    app.cleanup_ctx.append(_engines)
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/health/live", handlers.live)
    return app


async def _engines(app: web.Application) -> AsyncIterator[None]:
    """Open the engine channels, probe them once, keep probing while the app runs."""
    config, pool = app[CONFIG], app[POOL]
    await pool.start()
    statuses = await pool.probe_all()
    for address, status in statuses.items():
        if status is None:
            log.warning("engine %s does not answer GetStatus yet; requests get 503 no_engine "
                        "until it does (retrying every %.1f s)", address, config.health_interval_s)
    log.info("gateway: %d engine(s), %d ready; caps %d in flight per engine, %d queued",
             len(statuses), sum(bool(s and s.ready) for s in statuses.values()),
             config.max_inflight, config.max_queue)
    task = asyncio.create_task(_probe_forever(pool, config.health_interval_s))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await pool.close()


async def _probe_forever(pool: EnginePool, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            await pool.probe_all()
        except Exception:  # a probe bug must not stop probing
            log.exception("engine probe failed unexpectedly; retrying in %.1f s", interval_s)
