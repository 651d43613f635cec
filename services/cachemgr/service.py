"""The CacheManager gRPC servicer: proto messages stop here.

Requests become the dataclasses of `manager`; `InvalidRequest` maps to INVALID_ARGUMENT and
anything unexpected is logged and answered INTERNAL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import grpc

from services.cachemgr.manager import (
    CacheManager,
    EngineFigures,
    InvalidRequest,
    LinkFigures,
    PlanRequest,
    RoutingReport,
    counts_from_flat,
)
from services.cachemgr.planner import ModelShape, Plan
from services.common import counters
from services.common.pb.strata.v1 import cachemgr_pb2, cachemgr_pb2_grpc

log = logging.getLogger("strata.cachemgr")

SERVICE_NAME = "strata.v1.CacheManager"


def _slots(request: cachemgr_pb2.GetPlanRequest | cachemgr_pb2.WatchPlansRequest) -> int | None:
    return request.slots if request.HasField("slots") else None


def _shape(model: cachemgr_pb2.ModelShape) -> ModelShape:
    return ModelShape(model.fingerprint, model.num_layers, model.num_experts, model.slot_bytes,
                      model.name, model.experts_per_token)


def _plan_message(plan: Plan) -> cachemgr_pb2.Plan:
    return cachemgr_pb2.Plan(
        version=plan.version, slots=plan.slots, total_pairs=plan.total_pairs,
        pairs=[cachemgr_pb2.Pair(layer=layer, expert=expert) for layer, expert in plan.pairs],
        source=plan.source, reason=plan.reason)


def _optional(message, field: str):
    return getattr(message, field) if message.HasField(field) else None


def _report(request: cachemgr_pb2.RoutingReport) -> RoutingReport:
    shape = _shape(request.model)
    if problems := shape.problems():
        raise InvalidRequest("; ".join(problems))
    extra = LinkFigures(*(_optional(request, f) for f in (
        "link_bytes", "link_busy_s", "requests_running", "requests_waiting")))
    return RoutingReport(
        request.engine_id, shape, counts_from_flat(request.counts, shape),
        counters.from_proto(request.decode), request.tokens_generated, request.slots,
        request.device_memory_bytes, request.reserved_bytes, request.plan_version, extra,
        counts_from_flat(request.decode_counts, shape))


def _engine_message(e: EngineFigures, now_s: float) -> cachemgr_pb2.EngineOverview:
    optional = {k: v for k, v in (
        ("prefetch_precision", e.prefetch_precision), ("link_bytes_per_s", e.link_bytes_per_s),
        ("requests_running", e.requests_running), ("requests_waiting", e.requests_waiting),
    ) if v is not None}
    return cachemgr_pb2.EngineOverview(
        engine_id=e.engine_id, model=e.fingerprint, model_name=e.model_name, slots=e.slots,
        total_pairs=e.total_pairs, coverage=e.coverage, device_memory_bytes=e.device_memory_bytes,
        plan_version=e.plan_version, lookups=e.lookups, hits=e.hits, spilled=e.spilled,
        tokens_generated=e.tokens_generated, hit_ratio=e.latest_hit_ratio,
        spill_ratio=e.latest_spill_ratio,
        tokens_per_s=e.tokens_per_s,
        seconds_since_report=now_s - e.reported_s if e.reported_s else -1.0, **optional)


def overview_message(manager: CacheManager) -> cachemgr_pb2.Overview:
    now_s = time.monotonic()
    d = manager.device()
    device = cachemgr_pb2.DeviceOverview(
        kind=d.kind, name=d.name, memory_total_bytes=d.total_bytes,
        memory_used_bytes=d.used_bytes, memory_free_bytes=d.free_bytes,
        **{k: v for k, v in (("utilization", d.utilization), ("power_w", d.power_w),
                             ("temperature_c", d.temperature_c), ("sm_clock_hz", d.sm_clock_hz),
                             ("joules_per_token", manager.energy.joules_per_token()))
           if v is not None})
    models = [cachemgr_pb2.ModelOverview(
        model=m.fingerprint, model_name=m.name, plan_version=m.version, source=m.source,
        drift=m.drift, watched_slots=m.watch_slots) for m in manager.planner.status()]
    return cachemgr_pb2.Overview(
        engines=[_engine_message(e, now_s) for e in manager.snapshot()], models=models,
        device=device, uptime_s=now_s - manager.started_s,
        routing_store=manager.store.description)


class CacheManagerServicer(cachemgr_pb2_grpc.CacheManagerServicer):
    def __init__(self, manager: CacheManager) -> None:
        self.manager = manager

    async def GetPlan(self, request: cachemgr_pb2.GetPlanRequest,
                      context: grpc.aio.ServicerContext) -> cachemgr_pb2.Plan:
        async with _status_mapping(context, "GetPlan"):
            plan = await self.manager.get_plan(PlanRequest(
                request.engine_id, _shape(request.model), request.device_memory_bytes,
                request.reserved_bytes, _slots(request)))
            return _plan_message(plan)

    async def WatchPlans(self, request: cachemgr_pb2.WatchPlansRequest,
                         context: grpc.aio.ServicerContext) -> AsyncIterator[cachemgr_pb2.Plan]:
        async with _status_mapping(context, "WatchPlans"):
            await context.send_initial_metadata(())  # tells the engine it is subscribed
            plan_request = PlanRequest(request.engine_id, _shape(request.model),
                                       request.device_memory_bytes, request.reserved_bytes,
                                       _slots(request))
            async for plan in self.manager.watch(plan_request, request.known_version):
                yield _plan_message(plan)

    async def ReportRouting(self, request: cachemgr_pb2.RoutingReport,
                            context: grpc.aio.ServicerContext) -> cachemgr_pb2.ReportAck:
        async with _status_mapping(context, "ReportRouting"):
            version = await self.manager.report(_report(request))
            return cachemgr_pb2.ReportAck(plan_version=version)

    async def GetOverview(self, request: cachemgr_pb2.OverviewRequest,
                          context: grpc.aio.ServicerContext) -> cachemgr_pb2.Overview:
        async with _status_mapping(context, "GetOverview"):
            return overview_message(self.manager)


@contextlib.asynccontextmanager
async def _status_mapping(context: grpc.aio.ServicerContext, method: str):
    """The one place that turns errors into gRPC status codes; no traceback reaches a client."""
    try:
        yield
    except InvalidRequest as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    except (asyncio.CancelledError, grpc.aio.AbortError):
        raise
    except Exception:
        log.exception("%s failed", method)
        await context.abort(grpc.StatusCode.INTERNAL,
                            f"cache manager error in {method}; see the cachemgr log")
