"""Probes and info routes: `/livez`, `/readyz`, deep `/health`, `/v1/models`.

- `/livez`: the process is up and its event loop answers. Never looks at engines.
- `/readyz`: 200 while an engine is ready (last probe, breaker closed) and the gateway is not
  draining; 503 otherwise. Cheap: reads cached state, so load balancers may poll it often.
- `/health`: deep. A real 1-token generation on the least-loaded ready engine, outside the
  admission caps (at most one at a time, the result cached for `--health-cache-s`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from services.gateway.engine_client import Finished
from services.gateway.engines import served_models
from services.gateway.errors import EngineError, ModelNotFound
from services.gateway.schemas import GenerateInput, Sampling
from services.gateway.state import ADMISSION, CONFIG, POOL

_PROBE_SPEC = GenerateInput(model="", prompts=("ping",),
                            sampling=Sampling(temperature=0.0, max_tokens=1))


@dataclass
class DeepCheck:
    """The last deep-health generation, shared by every /health caller while fresh."""

    ok: bool = False
    checked_at: float = -1e9
    detail: dict[str, Any] | None = None
    lock: asyncio.Lock | None = None


DEEP = web.AppKey("deep_health", DeepCheck)


async def livez(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def _state(app: web.Application) -> dict[str, Any]:
    pool, admission = app[POOL], app[ADMISSION]
    engines = [{"address": a, "ready": a in admission.ready_engines,
                "engine_id": s and s.engine_id, "model": s and s.model,
                "running": s and s.running, "waiting": s and s.waiting,
                "breaker": pool.breakers[a].state if a in pool.breakers else None,
                "source": "registry" if a in pool.discovered else "static"}
               for a, s in pool.statuses.items()]
    status = ("draining" if admission.draining
              else "ok" if admission.ready_engines else "no_engine")
    return {"status": status, "engines": engines, "inflight": admission.num_inflight,
            "queued": admission.num_waiting, "capacity": admission.capacity,
            "limits": admission.ledger.mode}


async def readyz(request: web.Request) -> web.Response:
    state = _state(request.app)
    return web.json_response(state, status=200 if state["status"] == "ok" else 503)


async def health(request: web.Request) -> web.Response:
    app = request.app
    if not app[ADMISSION].ready_engines:
        await app[POOL].probe_all()
    state = _state(app)
    if state["status"] == "ok":
        check = await _deep_check(app)
        state["generation"] = check.detail
        if not check.ok:
            state["status"] = "generation_failed"
    return web.json_response(state, status=200 if state["status"] == "ok" else 503)


async def _deep_check(app: web.Application) -> DeepCheck:
    check, config = app[DEEP], app[CONFIG]
    if check.lock is None:
        check.lock = asyncio.Lock()
    async with check.lock:  # callers arriving during a check share its result
        if time.monotonic() - check.checked_at < config.health_cache_s:
            return check
        check.ok, check.detail = await _generate_one_token(app)
        check.checked_at = time.monotonic()
    return check


async def _generate_one_token(app: web.Application) -> tuple[bool, dict[str, Any]]:
    pool, admission, config = app[POOL], app[ADMISSION], app[CONFIG]
    ready = admission.ready_engines
    if not ready:
        return False, {"ok": False, "error": "no engine is ready"}
    engine = min(ready, key=admission.load)
    started = time.monotonic()
    try:
        async with pool.generate(engine, _PROBE_SPEC, "health-" + uuid.uuid4().hex[:12],
                                 timeout_s=config.engine_timeout_s * 5) as call:
            async for event in call.events():
                if isinstance(event, Finished):
                    ok = event.reason != "abort"
                    return ok, {"ok": ok, "engine": engine, "finish_reason": event.reason,
                                "ms": round((time.monotonic() - started) * 1e3, 3),
                                **({"error": event.error} if not ok else {})}
        return False, {"ok": False, "engine": engine, "error": "stream ended without Finished"}
    except EngineError as exc:
        return False, {"ok": False, "engine": engine, "error": f"{exc.code}: {exc.details}"}


async def models(request: web.Request) -> web.Response:
    served = await served_models(request.app)
    return web.json_response({"object": "list", "data": [_model(m) for m in served]})


async def model(request: web.Request) -> web.Response:
    """OpenAI's GET /v1/models/{model} (the openai client's models.retrieve)."""
    name, served = request.match_info["model"], await served_models(request.app)
    if name not in served:
        raise ModelNotFound(name, served)
    return web.json_response(_model(name))


def _model(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "strata"}
