"""Typed keys for what the gateway keeps on its aiohttp application and requests."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from opentelemetry.trace import Tracer

from services.common.genai_metrics import GenAIMetrics
from services.gateway.admission import Admission, RejectionLog
from services.gateway.background import BackgroundRuns
from services.gateway.config import GatewayConfig
from services.gateway.engine_client import EnginePool
from services.gateway.response_store import ResponseStore
from services.gateway.tracing import TraceContext

CONFIG = web.AppKey("config", GatewayConfig)
ADMISSION = web.AppKey("admission", Admission)
POOL = web.AppKey("pool", EnginePool)
REQUEST_ID = web.RequestKey("request_id", str)
TRACE = web.RequestKey("trace", TraceContext)
TRACER = web.AppKey("tracer", Tracer)
METRICS = web.AppKey("metrics", GenAIMetrics)  # the request metrics (GenAI conventions)
REJECTIONS = web.AppKey("rejections", RejectionLog)  # admission's, in the log
RESPONSE_STORE = web.AppKey("response_store", ResponseStore)  # the Responses API's records
BACKGROUND = web.AppKey("background", BackgroundRuns)  # background responses running here
CLOCK = web.AppKey("clock", Callable[[], float])  # monotonic seconds: durations, deadlines


def request_id(request: web.Request) -> str:
    return request[REQUEST_ID]
