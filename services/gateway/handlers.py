"""HTTP handlers: OpenAI routes, health, and the middlewares that wrap them.

Request path for a generation:

    auth (headers only) -> admission.enter() -> read + parse body -> check model
        -> admission.acquire() -> engine Generate -> JSON body | SSE stream -> release

`enter()` answers 429/503 before the body is read, so a rejected request costs nothing. The
server runs with handler_cancellation, so a client that leaves cancels the handler: a queued
request gives up its place, a running one cancels its gRPC call (GenerateCall's exit).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web

from services.gateway import sse
from services.gateway.admission import Admission, Rejected
from services.gateway.config import GatewayConfig
from services.gateway.engine_client import Delta, EnginePool, Finished, GenerateCall, Started
from services.gateway.errors import (
    EngineAborted,
    EngineError,
    InvalidRequest,
    ModelNotFound,
    Unauthorized,
    http_error,
)
from services.gateway.responses import ChatRenderer, CompletionRenderer, Figures, Renderer, usage
from services.gateway.schemas import GenerateInput, parse_chat, parse_completion

log = logging.getLogger("strata.gateway")

CONFIG = web.AppKey("config", GatewayConfig)
ADMISSION = web.AppKey("admission", Admission)
POOL = web.AppKey("pool", EnginePool)
REQUEST_ID = web.RequestKey("request_id", str)

_VALID_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_PUBLIC_PATHS = ("/health",)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# -- middlewares -------------------------------------------------------------------------------


def request_id(request: web.Request) -> str:
    return request[REQUEST_ID]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Request ids, and the one place exceptions become OpenAI error envelopes."""
    given = request.headers.get("X-Request-Id", "")
    request[REQUEST_ID] = given if _VALID_REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
    try:
        response = await handler(request)
    except web.HTTPException as exc:  # aiohttp's own: unknown route, wrong method, body too big
        if exc.status < 400:
            raise
        response = _error_response(request, exc.status, {"error": {
            "message": f"{exc.reason}: {request.method} {request.path}",
            "type": "invalid_request_error", "param": None, "code": _slug(exc.reason)}}, {})
    except Exception as exc:
        error = http_error(exc, request_id(request), request.app[ADMISSION].retry_after_s())
        _log_failure(request, exc, error.status)
        response = _error_response(request, error.status, error.body, error.headers)
    if not response.prepared:
        response.headers["X-Request-Id"] = request_id(request)
    return response


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    keys = request.app[CONFIG].api_keys
    if keys and not request.path.startswith(_PUBLIC_PATHS):
        header = request.headers.get("Authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        if not any(hmac.compare_digest(key.strip().encode(), k.encode()) for k in keys):
            raise Unauthorized("invalid API key")
    return await handler(request)


def _error_response(request: web.Request, status: int, body: dict[str, Any],
                    headers: dict[str, str]) -> web.Response:
    return web.json_response(body, status=status, headers=headers)


def _log_failure(request: web.Request, exc: Exception, status: int) -> None:
    where = f"{request.method} {request.path} request {request_id(request)}"
    if status >= 500 and not isinstance(exc, EngineError | EngineAborted | Rejected):
        log.exception("%s failed with an unexpected error; answered 500", where)
    elif status >= 500 or isinstance(exc, EngineError | EngineAborted):
        log.warning("%s: %s -> %d", where, exc, status)
    else:
        log.info("%s: %s -> %d", where, exc, status)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


# -- info routes -------------------------------------------------------------------------------


async def models(request: web.Request) -> web.Response:
    served = await _served_models(request.app)
    return web.json_response({"object": "list", "data": [
        {"id": m, "object": "model", "created": 0, "owned_by": "strata"} for m in served]})


async def health(request: web.Request) -> web.Response:
    """Deep health: asks every engine now. 200 when one is ready, else 503."""
    pool, admission = request.app[POOL], request.app[ADMISSION]
    statuses = await pool.probe_all()
    engines = [{"address": a, "ready": bool(s and s.ready), "engine_id": s and s.engine_id,
                "model": s and s.model, "running": s and s.running, "waiting": s and s.waiting}
               for a, s in statuses.items()]
    ready = any(e["ready"] for e in engines)
    return web.json_response({
        "status": "ok" if ready else "no_engine", "engines": engines,
        "inflight": admission.num_inflight, "queued": admission.num_waiting,
        "capacity": admission.capacity}, status=200 if ready else 503)


async def live(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _served_models(app: web.Application) -> list[str]:
    pool = app[POOL]
    if not pool.models:  # the cache is empty or stale: ask the engines again
        await pool.probe_all()
    if not pool.models:
        raise Rejected("no_engine", app[ADMISSION].retry_after_s(),
                       "no engine answers GetStatus")
    return pool.models


# -- generation --------------------------------------------------------------------------------


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_chat, ChatRenderer)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_completion, CompletionRenderer)


@dataclass
class _Run:
    """What one generation needs while it answers."""

    request: web.Request
    spec: GenerateInput
    renderer: Renderer
    call: GenerateCall
    started: Started
    arrived_at: float
    queue_wait_s: float
    first_token_at: float | None = None
    num_deltas: int = 0

    def figures(self, finished: Finished) -> Figures:
        s = finished.stats
        first = self.first_token_at or time.monotonic()
        return Figures(
            engine_id=self.started.engine_id,
            queue_wait_ms=self.queue_wait_s * 1e3, ttft_ms=(first - self.arrived_at) * 1e3,
            engine_queue_ms=s.queue_ms, decode_tok_s=s.decode_tok_s, expert_hit_rate=s.hit_rate,
            spill_ratio=s.spill_ratio, reused_prompt_tokens=s.reused_prompt_tokens)

    def usage(self, finished: Finished) -> dict[str, int]:
        stats = finished.stats
        return usage(stats.prompt_tokens or self.started.prompt_tokens,
                     stats.completion_tokens or self.num_deltas)

    def log_done(self, finished: Finished) -> None:
        u, f = self.usage(finished), self.figures(finished)
        log.info("request %s done (%s): %d prompt + %d completion tokens, queue %.0f ms, "
                 "ttft %.0f ms, %.1f tok/s, hit rate %.3f, spill %.3f, engine %s",
                 request_id(self.request), finished.reason, u["prompt_tokens"],
                 u["completion_tokens"], f.queue_wait_ms, f.ttft_ms, f.decode_tok_s,
                 f.expert_hit_rate, f.spill_ratio, f.engine_id)


async def _generate(request: web.Request, parse: Callable[[Any], GenerateInput],
                    renderer_cls: type[Renderer]) -> web.StreamResponse:
    app = request.app
    admission, pool = app[ADMISSION], app[POOL]
    arrived_at = time.monotonic()
    ticket = admission.enter()  # 429 / 503 before the body is even read
    engine_used = False
    try:
        spec = parse(await _read_json(request))
        served = await _served_models(app)
        if spec.model not in served:  # the engines may have been restarted with another model
            await pool.probe_all()
            if spec.model not in (served := await _served_models(app)):
                raise ModelNotFound(spec.model, served)
        engine = await admission.acquire(ticket, app[CONFIG].queue_timeout_s)
        engine_used = True
        async with pool.generate(engine, spec, request_id(request)) as call:
            event = await call.next_event()  # a bad prompt fails here, before any output
            if not isinstance(event, Started):
                raise EngineError("INTERNAL", f"expected Started first, got {event!r}", engine)
            if not event.engine_id:
                status = pool.statuses.get(engine)
                event = replace(event, engine_id=status.engine_id if status else engine)
            run = _Run(request, spec, renderer_cls(request_id(request), spec.model), call, event,
                       arrived_at, ticket.queue_wait_s)
            return await (_stream(run) if spec.stream else _complete(run))
    except asyncio.CancelledError:
        log.info("request %s: client went away after %.0f ms (%s); %s", request_id(request),
                 (time.monotonic() - arrived_at) * 1e3,
                 "engine call cancelled" if engine_used else "left the queue",
                 "its slot is free again" if engine_used else "nothing reached the engine")
        raise
    finally:
        admission.release(ticket, observed=engine_used)


async def _read_json(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}",
                             code="invalid_json") from None


async def _complete(run: _Run) -> web.Response:
    parts: list[str] = []
    async for event in run.call.events():
        if isinstance(event, Delta):
            run.first_token_at = run.first_token_at or time.monotonic()
            run.num_deltas += event.num_tokens or 1
            parts.append(event.text)
        elif isinstance(event, Finished):
            if event.reason == "abort":
                raise EngineAborted(event.error, run.call.engine)
            run.log_done(event)
            figures = run.figures(event)
            body = run.renderer.full("".join(parts), event.reason, run.usage(event), figures)
            return web.json_response(body, headers=figures.headers())
    raise EngineError("INTERNAL", "the event stream ended without a Finished event",
                      run.call.engine)


async def _stream(run: _Run) -> web.StreamResponse:
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
        "X-Request-Id": request_id(run.request),
        "x-strata-queue-wait-ms": f"{run.queue_wait_s * 1e3:.3f}",
        "x-strata-engine-id": run.started.engine_id})
    await response.prepare(run.request)
    try:
        await response.write(sse.event(run.renderer.chunk(first=True)))
        async for event in run.call.events():
            if isinstance(event, Delta):
                run.first_token_at = run.first_token_at or time.monotonic()
                run.num_deltas += event.num_tokens or 1
                await response.write(sse.event(run.renderer.chunk(text=event.text)))
            elif isinstance(event, Finished):
                if event.reason == "abort":
                    raise EngineAborted(event.error, run.call.engine)
                await _finish_stream(run, response, event)
                return response
        raise EngineError("INTERNAL", "the event stream ended without a Finished event",
                          run.call.engine)
    except ConnectionResetError:
        log.info("request %s: client went away mid-stream; engine call cancelled",
                 request_id(run.request))
    except Exception as exc:  # headers are sent: the error goes out as an event, and no [DONE]
        error = http_error(exc, request_id(run.request))
        _log_failure(run.request, exc, error.status)
        with contextlib.suppress(ConnectionResetError):
            await response.write(sse.event(error.body))
    return response


async def _finish_stream(run: _Run, response: web.StreamResponse, finished: Finished) -> None:
    figures = run.figures(finished)
    await response.write(sse.event(run.renderer.chunk(finish_reason=finished.reason,
                                                      figures=figures)))
    if run.spec.include_usage:
        await response.write(sse.event(run.renderer.usage_chunk(run.usage(finished), figures)))
    await response.write(sse.DONE)
    run.log_done(finished)
