"""Middlewares around every route: request id and trace context, the one place exceptions become
OpenAI error envelopes, the body-size limit, and API keys.

API keys are held only as SHA-256 digests; a presented key is hashed and compared with every
stored digest in constant time, so neither the key file nor the timing gives keys away.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from opentelemetry.trace import StatusCode

from services.gateway import tracing
from services.gateway.admission import Rejected, estimate_prompt_tokens
from services.gateway.errors import (
    EngineAborted,
    EngineError,
    GatewayError,
    PayloadTooLarge,
    Unauthorized,
    http_error,
)
from services.gateway.state import (
    ADMISSION,
    CLOCK,
    CONFIG,
    METRICS,
    REJECTIONS,
    REQUEST_ID,
    TRACE,
    TRACER,
    request_id,
)

log = logging.getLogger("strata.gateway")

_VALID_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
PUBLIC_PATHS = frozenset({"/health", "/health/live", "/livez", "/readyz", "/openapi.json"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _request_id_of(request: web.Request) -> str:
    """The client's X-Request-Id when it is a sane one, else a new id."""
    given = request.headers.get("X-Request-Id", "")
    return given if _VALID_REQUEST_ID.fullmatch(given) else uuid.uuid4().hex


GENERATE_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}


@web.middleware
async def shed_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A generation request admission would refuse is answered here, before anything else is
    done for it (a span, the API key, the body, a Redis round trip): from its Content-Length
    and this gateway's own counts (Admission.refusal). Its envelope, headers, log and metrics
    are the ones the handler would give; it has no trace span."""
    clock = request.app[CLOCK]
    started = clock()
    operation = GENERATE_PATHS.get(request.path)
    if operation is None or request.method != "POST" or request.content_length is None:
        return await handler(request)
    refused = request.app[ADMISSION].refusal(estimate_prompt_tokens(request.content_length))
    if refused is None:
        return await handler(request)
    rid = _request_id_of(request)
    error = http_error(refused, rid)
    request.app[REJECTIONS].add(f"POST {request.path} request {rid}", refused, error.status)
    request.app[METRICS].record_request("", clock() - started, error_type=refused.reason,
                                        operation=operation)
    return web.json_response(error.body, status=error.status,
                             headers={**error.headers, "X-Request-Id": rid})


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Request ids, the request's server span, and the one place exceptions become OpenAI
    error envelopes."""
    request[REQUEST_ID] = _request_id_of(request)
    resource = request.match_info.route.resource
    span = tracing.start_server_span(request.app[TRACER], request.method,
                                     resource.canonical if resource else "(unmatched)",
                                     request.headers)
    request[TRACE] = tracing.TraceContext(span)
    span.set_attribute("strata.request_id", request_id(request))
    try:
        response = await _handle(request, handler)
    except BaseException as exc:  # cancelled (the client went away)
        span.set_attribute("error.type", type(exc).__name__)
        raise
    else:
        span.set_attribute("http.response.status_code", response.status)
        if response.status >= 500:
            span.set_status(StatusCode.ERROR)
            span.set_attribute("error.type", str(response.status))
        return response
    finally:
        span.end()


async def _handle(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        response = await handler(request)
    except web.HTTPException as exc:  # aiohttp's own: unknown route, wrong method, body too big
        if exc.status < 400:
            raise
        response = web.json_response({"error": {
            "message": f"{exc.reason}: {request.method} {request.path}",
            "type": "invalid_request_error", "param": None, "code": _slug(exc.reason)}},
            status=exc.status, headers={k: v for k, v in exc.headers.items()
                                        if k.lower() == "allow"})  # a 405's methods
    except Exception as exc:
        error = http_error(exc, request_id(request), request.app[ADMISSION].retry_after_s())
        log_failure(request, exc, error.status)
        response = web.json_response(error.body, status=error.status, headers=error.headers)
    if not response.prepared:
        response.headers["X-Request-Id"] = request_id(request)
    return response


@web.middleware
async def limits_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse an announced over-size body before anything reads it (aiohttp's client_max_size
    catches the rest, e.g. chunked bodies, while reading)."""
    limit = request.app[CONFIG].max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(request.content_length, limit)
    return await handler(request)


class ApiKeys:
    def __init__(self, digests: frozenset[bytes]) -> None:
        self._digests = tuple(digests)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def accepts(self, key: str) -> bool:
        digest = hashlib.sha256(key.encode()).digest()
        matched = False
        for stored in self._digests:  # every digest, no early exit
            matched |= hmac.compare_digest(digest, stored)
        return matched


def auth_middleware(keys: ApiKeys) -> Any:
    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if keys.enabled and request.path not in PUBLIC_PATHS:
            scheme, _, key = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not key.strip():
                raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
            if not keys.accepts(key.strip()):
                raise Unauthorized("invalid API key")
        return await handler(request)

    return auth


def log_failure(request: web.Request, exc: BaseException, status: int) -> None:
    """One line per failed request. A client error's message may quote the request (a bad
    value, a model name, an engine refusing the prompt), so its line says what kind of error it
    was and only DEBUG has the message."""
    where = (f"{request.method} {request.path} request {request_id(request)} "
             f"trace {request[TRACE].trace_id}")
    if isinstance(exc, Rejected):
        request.app[REJECTIONS].add(where, exc, status)
    elif status >= 500 and not isinstance(exc, EngineError | EngineAborted):
        log.error("%s failed with an unexpected error; answered 500", where, exc_info=exc)
    elif status >= 500:
        log.warning("%s: %s -> %d", where, exc, status)
    else:
        level = logging.WARNING if isinstance(exc, EngineError) else logging.INFO
        log.log(level, "%s: %s -> %d", where, _client_error_kind(exc), status)
        log.debug("%s: %s", where, exc)


def _client_error_kind(exc: BaseException) -> str:
    """A client error without its message: the error's code and parameter, or the engine's."""
    if isinstance(exc, GatewayError):
        return f"{type(exc).__name__} ({exc.code or 'no code'}, param {exc.param or '-'})"
    if isinstance(exc, EngineError):
        return f"engine {exc.engine} answered {exc.code}"
    return type(exc).__name__


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")
