"""The cache manager daemon: gRPC server (CacheManager + grpc.health.v1) and its background loop.

Every tick (FLUSH_INTERVAL_S) the loop flushes routing counts buffered while Redis was away,
folds fresh counts and decay into the live profiles (which may issue plan versions), and samples
the device. Every `profile_save_interval_s` it saves the live profiles, and once at shutdown;
every SUMMARY_INTERVAL_S it logs a per-engine summary.
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
from services.cachemgr.device import DeviceMonitor
from services.cachemgr.manager import CacheManager, EngineFigures
from services.cachemgr.metrics import register_metrics
from services.cachemgr.planner import Planner
from services.cachemgr.profiles import ProfileFiles
from services.cachemgr.service import SERVICE_NAME, CacheManagerServicer
from services.cachemgr.store import open_store
from services.common.pb.strata.v1 import cachemgr_pb2_grpc
from services.common.settings import format_bytes

log = logging.getLogger("strata.cachemgr")

FLUSH_INTERVAL_S = 2.0
SUMMARY_INTERVAL_S = 60.0

__all__ = ["SERVICE_NAME", "Daemon", "serve", "start_daemon"]


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
    profile_files: ProfileFiles | None
    loop_task: asyncio.Task | None = None

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def save_profiles(self) -> None:
        if self.profile_files is None:
            return
        for profile in self.manager.planner.profiles_to_save():
            written = await asyncio.to_thread(self.profile_files.save, [profile])
            if not written:
                self.manager.planner.mark_unsaved(profile.fingerprint)

    async def stop(self, grace_s: float = 5.0) -> None:
        await self.health.enter_graceful_shutdown()
        self.manager.close_watches()  # streams end now rather than hold the grace period
        await self.server.stop(grace_s)
        if self.loop_task is not None:
            self.loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.loop_task
        await self.save_profiles()
        await self.manager.store.close()
        if self.owns_meter_provider and self.meter_provider is not None:
            self.meter_provider.shutdown()
        log.info("cache manager on %s stopped", self.address)


async def start_daemon(config: CacheMgrConfig, meter_provider: MeterProvider | None = None,
                       monitor: DeviceMonitor | None = None) -> Daemon:
    """Start the gRPC server and the loop. Without `meter_provider`, one is set up from the
    config (Prometheus on metrics_port, OTLP when configured) and shut down by `stop()`.
    Raises ProfileError when the profile file is corrupt."""
    from services.common.telemetry import setup_metrics

    files = ProfileFiles(config.profile_path) if config.profile_path else None
    planner = Planner(files.load() if files else None, half_life_s=config.profile_half_life_s,
                      replan_drift=config.replan_drift,
                      replan_settle_s=config.replan_settle_s)
    owns = meter_provider is None
    if meter_provider is None:
        meter_provider = setup_metrics("strata-cachemgr", config.metrics_port or None)
    store = open_store(config.redis_url)
    manager = CacheManager(planner, store, config.reserve_bytes, config.device_memory_bytes,
                           monitor=monitor or DeviceMonitor.detect())
    manager.sample_device()
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
    daemon = Daemon(config, manager, server, health, port, meter_provider, owns, files)
    daemon.loop_task = asyncio.create_task(_loop(daemon), name="cachemgr-loop")
    budget = (format_bytes(config.device_memory_bytes) if config.device_memory_bytes
              else "free device memory")
    device = manager.device()
    log.info("cache manager serving on %s: routing counts %s; budget %s when engines do not "
             "say, %s reserved; device %s (%s); live profile %s (half-life %.0f s, re-plan at "
             "%.1f%% drift)", daemon.address, store.description, budget,
             format_bytes(config.reserve_bytes), device.kind, device.name,
             config.profile_path or "not saved", config.profile_half_life_s,
             100 * config.replan_drift)
    return daemon


async def _loop(daemon: Daemon) -> None:
    manager, config = daemon.manager, daemon.config
    last_summary_s = last_save_s = last_sample_s = time.monotonic()
    previous: dict[str, EngineFigures] = {}
    while True:
        await asyncio.sleep(min(FLUSH_INTERVAL_S, config.sample_interval_s))
        try:
            now_s = time.monotonic()
            if now_s - last_sample_s >= config.sample_interval_s:
                last_sample_s = now_s
                manager.sample_device(now_s)
            await manager.store.flush()
            await manager.refresh_models()
            interval_s = config.profile_save_interval_s
            if interval_s and now_s - last_save_s >= interval_s:
                last_save_s = now_s
                await daemon.save_profiles()
            if now_s - last_summary_s >= SUMMARY_INTERVAL_S:
                last_summary_s = now_s
                previous = _log_summary(manager.snapshot(), previous)
        except Exception:  # the loop must outlive any one failure
            log.exception("cache manager loop step failed; continuing")


def _log_summary(engines: list[EngineFigures],
                 previous: dict[str, EngineFigures]) -> dict[str, EngineFigures]:
    for e in engines:
        before = previous.get(e.engine_id)
        d = e.decode.since(before.decode) if before else e.decode
        if d.lookups <= 0:
            continue
        log.info("engine %s: %d slots (coverage %.1f%% of %d pairs), plan v%d; last %.0f s: hit "
                 "rate %.1f%% (%d hits / %d decode lookups), %d spilled, served by no slot "
                 "(%.2f%%: %d run from host memory, %d copied over the link first)", e.engine_id,
                 e.slots, 100 * e.coverage, e.total_pairs, e.plan_version, SUMMARY_INTERVAL_S,
                 100 * d.hit_rate, d.hits, d.lookups, d.spilled, 100 * d.spill_ratio,
                 d.misses_host, d.misses_copied)
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
