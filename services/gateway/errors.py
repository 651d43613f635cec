"""The gateway's named errors and the one place they become HTTP answers.

Every failure a client sees goes through `http_error()`: an OpenAI error envelope
`{"error": {"message", "type", "param", "code"}}`, a status and headers. gRPC status codes from
the engine arrive as `EngineError(code_name)` (the engine client translates them at its edge), so
this module maps them without importing grpc.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.gateway.admission import UNAVAILABLE_REASONS, Rejected


class GatewayError(Exception):
    """An error with a known HTTP answer."""

    status = 500
    type = "server_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None,
                 code: str | None = "invalid_value") -> None:
        super().__init__(message, param, code)


def first_unknown(raw: dict[str, Any], fields: frozenset[str]) -> str | None:
    """The first key of `raw` (in sorted order) that is none of `fields`, a null not counted:
    a null asks for nothing."""
    return min((k for k, v in raw.items() if k not in fields and v is not None), default=None)


def refuse_unknown_keys(raw: dict[str, Any], fields: frozenset[str], param: str,
                        what: str) -> None:
    """A 400 naming the first key of the object `param` that is none of `fields` (a request
    field is implemented or refused by name, at every depth)."""
    if (name := first_unknown(raw, fields)) is not None:
        raise InvalidRequest(f"'{param}.{name}' is not a field of {what}: Strata reads "
                             f"{', '.join(sorted(fields))}", f"{param}.{name}",
                             code="unsupported_parameter")


class ModelNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"

    def __init__(self, model: str, served: list[str]) -> None:
        super().__init__(f"model {model!r} is not served here; available: {', '.join(served)}",
                         "model", "model_not_found")


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"

    def __init__(self, num_bytes: int, limit_bytes: int) -> None:
        super().__init__(f"the request body is {num_bytes} bytes; the limit is {limit_bytes}",
                         None, "request_too_large")


class Unauthorized(GatewayError):
    status = 401
    type = "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})


class EngineError(Exception):
    """A gRPC failure from an engine: `code` is the grpc.StatusCode name, e.g. 'UNAVAILABLE'."""

    def __init__(self, code: str, details: str, engine: str, param: str | None = None,
                 error_code: str | None = None) -> None:
        super().__init__(f"engine {engine} answered {code}: {details}")
        self.code = code
        self.details = details
        self.engine = engine
        self.param = param  # INVALID_ARGUMENT: the field at fault, where the engine named one
        self.error_code = error_code


class EngineAborted(Exception):
    """The engine ended the request with FINISH_REASON_ABORT."""

    def __init__(self, details: str, engine: str) -> None:
        super().__init__(f"engine {engine} aborted the request: {details or 'no reason given'}")
        self.details = details
        self.engine = engine


@dataclass(frozen=True)
class HttpError:
    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


def envelope(message: str, type_: str, param: str | None = None,
             code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def http_error(exc: BaseException, request_id: str = "", retry_after_s: int = 1) -> HttpError:
    """Map any exception to its HTTP answer. Unknown ones become a 500 without internals."""
    if isinstance(exc, GatewayError):
        return HttpError(exc.status, envelope(exc.message, exc.type, exc.param, exc.code),
                         dict(exc.headers))
    if isinstance(exc, Rejected):
        status = 503 if exc.reason in UNAVAILABLE_REASONS else 429
        type_ = "service_unavailable" if status == 503 else "rate_limit_exceeded"
        return HttpError(status, envelope(f"request dropped ({exc.reason}): {exc}; retry in "
                                          f"{exc.retry_after_s} s", type_, None, exc.reason),
                         _drop_headers(exc.reason, exc.retry_after_s))
    if isinstance(exc, EngineError):
        return _engine_error(exc, request_id, retry_after_s)
    if isinstance(exc, EngineAborted):
        return HttpError(500, envelope(f"the engine aborted this request ({_first_line(exc.details)})"
                                       f"; request id {request_id}", "server_error", None,
                                       "engine_aborted"))
    return HttpError(500, envelope(f"internal gateway error; the gateway log has details under "
                                   f"request id {request_id}", "server_error", None,
                                   "internal_error"))


def _engine_error(exc: EngineError, request_id: str, retry_after_s: int) -> HttpError:
    details = _first_line(exc.details)
    if exc.code == "INVALID_ARGUMENT":
        if exc.param is not None:
            return HttpError(400, envelope(details, "invalid_request_error", exc.param,
                                           exc.error_code or "invalid_value"))
        is_length = any(word in details.lower() for word in ("context", "token", "long"))
        return HttpError(400, envelope(details, "invalid_request_error", "messages",
                                       "context_length_exceeded" if is_length else "invalid_value"))
    if exc.code == "RESOURCE_EXHAUSTED":
        return HttpError(429, envelope(f"the engine is at capacity: {details}",
                                       "rate_limit_exceeded", None, "engine_busy"),
                         _drop_headers("engine_busy", retry_after_s))
    if exc.code == "DEADLINE_EXCEEDED":
        return HttpError(504, envelope(f"the request ran past its deadline at the engine "
                                       f"({details}); request id {request_id}", "timeout_error",
                                       None, "deadline_exceeded"))
    if exc.code == "UNAVAILABLE":
        return HttpError(503, envelope(f"the engine is unreachable: {details}",
                                       "service_unavailable", None, "no_engine"),
                         _drop_headers("no_engine", retry_after_s))
    return HttpError(500, envelope(f"the engine failed this request ({exc.code}: {details}); "
                                   f"request id {request_id}", "server_error", None,
                                   "engine_error"))


def _drop_headers(reason: str, retry_after_s: int) -> dict[str, str]:
    return {"Retry-After": str(max(1, retry_after_s)), "x-strata-drop-reason": reason}


def _first_line(text: str, limit: int = 300) -> str:
    line = text.strip().splitlines()[0] if text.strip() else "no details"
    return line[:limit]
