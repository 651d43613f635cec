"""The cache manager daemon: gRPC server (CacheManager + grpc.health.v1) and its background loop.

Proto messages stop here: the servicer converts them to the dataclasses of `manager` and maps
`InvalidRequest` to INVALID_ARGUMENT; anything unexpected is logged and answered INTERNAL.
The loop flushes routing counts buffered while Redis was away and logs a per-engine summary.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from opentelemetry.sdk.metrics import MeterProvider

from services.cachemgr.config import CacheMgrConfig
from services.cachemgr.manager import (
    CacheManager,
    EngineFigures,
    InvalidRequest,
    PlanRequest,
    RoutingReport,
    counts_from_flat,
)
from services.cachemgr.metrics import register_metrics
from services.cachemgr.planner import ModelShape, Planner
from services.cachemgr.store import open_store
from services.common.pb.strata.v1 import cachemgr_pb2, cachemgr_pb2_grpc
from services.common.profile import Profile
from services.common.settings import format_bytes

log = logging.getLogger("strata.cachemgr")

SERVICE_NAME = "strata.v1.CacheManager"
FLUSH_INTERVAL_S = 2.0
SUMMARY_INTERVAL_S = 60.0


def _shape(model: cachemgr_pb2.ModelShape) -> ModelShape:
    return ModelShape(model.fingerprint, model.num_layers, model.num_experts, model.slot_bytes,
                      model.name, model.experts_per_token)


class CacheManagerServicer(cachemgr_pb2_grpc.CacheManagerServicer):
    def __init__(self, manager: CacheManager) -> None:
        self.manager = manager

    async def GetPlan(self, request: cachemgr_pb2.GetPlanRequest,
                      context: grpc.aio.ServicerContext) -> cachemgr_pb2.Plan:
        async with _status_mapping(context, "GetPlan"):
            plan = await self.manager.get_plan(PlanRequest(
                request.engine_id, _shape(request.model), request.device_memory_bytes,
                request.reserved_bytes))
            return cachemgr_pb2.Plan(
                version=plan.version, slots=plan.slots, total_pairs=plan.total_pairs,
                pairs=[cachemgr_pb2.Pair(layer=layer, expert=expert)
                       for layer, expert in plan.pairs],
                source=plan.source)

    async def ReportRouting(self, request: cachemgr_pb2.RoutingReport,
                            context: grpc.aio.ServicerContext) -> cachemgr_pb2.ReportAck:
        async with _status_mapping(context, "ReportRouting"):
            shape = _shape(request.model)
            if problems := shape.problems():
                raise InvalidRequest("; ".join(problems))
            version = await self.manager.report(RoutingReport(
                request.engine_id, shape, counts_from_flat(request.counts, shape),
                request.lookups, request.hits, request.spilled, request.tokens_generated,
                request.slots, request.device_memory_bytes, request.reserved_bytes,
                request.plan_version))
            return cachemgr_pb2.ReportAck(plan_version=version)


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


@dataclass
class Daemon:
    """A running cache manager; `stop()` shuts it down gracefully."""

    config: CacheMgrConfig
    manager: CacheManager
    server: grpc.aio.Server
    health: health_aio.HealthServicer
    port: int
    meter_provider: MeterProvider | None
    owns_meter_provider: bool
    loop_task: asyncio.Task | None = None

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def stop(self, grace_s: float = 5.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        if self.loop_task is not None:
            self.loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.loop_task
        await self.manager.store.close()
        if self.owns_meter_provider and self.meter_provider is not None:
            self.meter_provider.shutdown()
        log.info("cache manager on %s stopped", self.address)


def load_profile(config: CacheMgrConfig) -> Profile | None:
    """The configured profile; None if unset or not written yet. Raises ProfileError if corrupt."""
    path = config.profile_path
    if path is None:
        return None
    if not path.exists():
        log.warning("no expert profile at %s yet; plans rank pairs by routing counts, else in "
                    "layer order", path)
        return None
    profile = Profile.read(path)
    log.info("expert profile %s: model %s, %d layers x %d experts, %d pairs ranked "
             "(built for %d slots)", path, profile.fingerprint, profile.num_layers,
             profile.num_experts, len(profile.ranked), profile.built_for_slots)
    return profile


async def start_daemon(config: CacheMgrConfig,
                       meter_provider: MeterProvider | None = None) -> Daemon:
    """Start the gRPC server and the loop. Without `meter_provider`, one is set up from the
    config (Prometheus on metrics_port, OTLP when configured) and shut down by `stop()`."""
    from services.common.telemetry import setup_metrics

    owns = meter_provider is None
    if meter_provider is None:
        meter_provider = setup_metrics("strata-cachemgr", config.metrics_port or None)
    store = open_store(config.redis_url)
    manager = CacheManager(Planner(load_profile(config)), store, config.reserve_bytes,
                           config.device_memory_bytes)
    register_metrics(meter_provider.get_meter("strata.cachemgr"), manager)

    server = grpc.aio.server()
    cachemgr_pb2_grpc.add_CacheManagerServicer_to_server(CacheManagerServicer(manager), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port(config.address)
    if port == 0:
        raise OSError(f"cannot bind the cache manager to {config.address}")
    await server.start()
    for service in ("", SERVICE_NAME):
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    daemon = Daemon(config, manager, server, health, port, meter_provider, owns)
    daemon.loop_task = asyncio.create_task(_loop(manager), name="cachemgr-loop")
    budget = (format_bytes(config.device_memory_bytes) if config.device_memory_bytes
              else "free device memory")
    log.info("cache manager serving on %s: routing counts %s; budget %s when engines do not "
             "say, %s reserved", daemon.address, store.description, budget,
             format_bytes(config.reserve_bytes))
    return daemon


async def _loop(manager: CacheManager) -> None:
    last_summary_s = time.monotonic()
    previous: dict[str, EngineFigures] = {}
    while True:
        await asyncio.sleep(FLUSH_INTERVAL_S)
        try:
            await manager.store.flush()
            if time.monotonic() - last_summary_s >= SUMMARY_INTERVAL_S:
                last_summary_s = time.monotonic()
                previous = _log_summary(manager.snapshot(), previous)
        except Exception:  # the loop must outlive any one failure
            log.exception("cache manager loop step failed; continuing")


def _log_summary(engines: list[EngineFigures],
                 previous: dict[str, EngineFigures]) -> dict[str, EngineFigures]:
    for e in engines:
        before = previous.get(e.engine_id)
        lookups = e.lookups - (before.lookups if before else 0)
        if lookups <= 0:
            continue
        hits = e.hits - (before.hits if before else 0)
        spilled = e.spilled - (before.spilled if before else 0)
        log.info("engine %s: %d slots (coverage %.1f%% of %d pairs); last %.0f s: hit rate "
                 "%.1f%% (%d hits / %d lookups), %d spilled (%.2f%%)", e.engine_id, e.slots,
                 100 * e.coverage, e.total_pairs, SUMMARY_INTERVAL_S, 100 * hits / lookups,
                 hits, lookups, spilled, 100 * spilled / lookups)
    return {e.engine_id: e for e in engines}


async def serve(config: CacheMgrConfig) -> None:
    """Run until SIGTERM or SIGINT, then stop gracefully."""
    daemon = await start_daemon(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        log.info("cache manager stopping (signal received)")
    finally:
        await daemon.stop()
