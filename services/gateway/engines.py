"""Which engine answers: the models the engines serve, and a ready engine for a model's unary
calls (the tokenizer RPCs), outside admission. Generation goes through admission instead."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from services.gateway.admission import Rejected
from services.gateway.errors import ModelNotFound
from services.gateway.state import ADMISSION, CONFIG, POOL


async def served_models(app: web.Application) -> list[str]:
    pool = app[POOL]
    if not pool.models:  # the cache is empty or stale: ask the engines again
        await pool.probe_all()
    if not pool.models:
        raise Rejected("no_engine", app[ADMISSION].retry_after_s(),
                       "no engine answers GetStatus")
    return pool.models


async def ready_engine(app: web.Application, model: str | None) -> str:
    """A ready engine serving `model` (None: any): its address."""
    served = await served_models(app)
    if model is not None and model not in served:
        raise ModelNotFound(model, served)
    statuses, admission = app[POOL].statuses, app[ADMISSION]
    for address in admission.ready_engines:
        status = statuses.get(address)
        if status is not None and (model is None or status.model == model):
            return address
    raise Rejected("no_engine", admission.retry_after_s(),
                   f"no engine serving {model or 'a model'} is ready")


async def tokenizer_call(app: web.Application, address: str, method: str, message: Any,
                         timeout_s: float | None = None) -> Any:
    """One of the engine's tokenizer RPCs (Tokenize, Detokenize, GetTokenizerInfo), within
    `timeout_s` (default: the request timeout)."""
    return await app[POOL].tokenizer(address, method, message,
                                     timeout_s or app[CONFIG].request_timeout_s)
