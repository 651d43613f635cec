"""The cache manager's state and operations, free of gRPC: plans for engines, routing reports,
plan watches, and the per-engine figures the metrics and the overview read.

    GetPlan ──> budget (request | --device-memory | free device memory) ──> Planner.plan
    ReportRouting ──> store.add(counts) ──> Planner.refresh ──> plan version ──> watchers
                  └─> per-engine running totals (lookups, hits, spilled, tokens) ──> metrics
    loop tick ──> refresh_models (fresh counts from Redis, decay) ──> Planner.refresh ──> watchers
              └─> sample_device ──> DeviceMonitor + EnergyMeter (J/token)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, fields, replace

import numpy as np

from services.cachemgr.device import (
    DeviceMemory,
    DeviceMonitor,
    DeviceSample,
    EnergyMeter,
    read_device_memory,
)
from services.cachemgr.planner import ModelShape, Plan, Planner
from services.cachemgr.store import DECODE, MemoryStore, RedisStore
from services.common.counters import CacheCounters, DecodeFigures
from services.common.settings import format_bytes

log = logging.getLogger("strata.cachemgr")


class InvalidRequest(ValueError):
    """A request the cache manager cannot act on; the message says what to fix."""


@dataclass(frozen=True)
class PlanRequest:
    engine_id: str
    shape: ModelShape
    device_memory_bytes: int  # 0 = use the daemon's budget
    reserved_bytes: int  # 0 = use the daemon's reserve
    slots: int | None = None  # the engine's own slot count (None: size from the budget)


@dataclass(frozen=True)
class LinkFigures:
    """Optional figures of one report (None: the engine does not measure them)."""

    link_bytes: int | None = None
    link_busy_s: float | None = None
    requests_running: int | None = None
    requests_waiting: int | None = None


@dataclass(frozen=True)
class RoutingReport:
    engine_id: str
    shape: ModelShape
    counts: np.ndarray | None  # [L, E] routed tokens per pair since the last report
    decode: CacheCounters  # the decode phase's cache counters since the last report
    tokens_generated: int
    slots: int
    device_memory_bytes: int
    reserved_bytes: int
    plan_version: int
    extra: LinkFigures = LinkFigures()
    decode_counts: np.ndarray | None = None  # [L, E] the decode-phase share of `counts`


@dataclass(frozen=True)
class EngineFigures(DecodeFigures):
    """One engine as the cache manager last heard of it; lookups/hits/spilled/tokens are running
    totals, the ratios and rates cover the latest report that had them."""

    engine_id: str
    fingerprint: str
    total_pairs: int
    model_name: str = ""
    slots: int = 0
    device_memory_bytes: int = 0
    reserved_bytes: int = 0
    plan_version: int = 0
    decode: CacheCounters = field(default_factory=CacheCounters)  # running totals
    latest: CacheCounters = field(default_factory=CacheCounters)  # the latest report's with lookups
    tokens_generated: int = 0
    tokens_per_s: float = 0.0
    link_bytes_per_s: float | None = None
    requests_running: int | None = None
    requests_waiting: int | None = None
    reported_s: float = 0.0  # monotonic time of the latest report (0 = none yet)

    @property
    def latest_hit_ratio(self) -> float:
        return self.latest.hit_rate

    @property
    def latest_spill_ratio(self) -> float:
        return self.latest.spill_ratio

    @property
    def prefetch_precision(self) -> float | None:
        """Of the latest report (None when it made no prediction: prefetch off)."""
        return self.latest.prefetch_precision if self.latest.predicted else None

    @property
    def coverage(self) -> float:
        return self.slots / self.total_pairs if self.total_pairs else 0.0


class CacheManager:
    def __init__(self, planner: Planner, store: MemoryStore | RedisStore, reserve_bytes: int,
                 device_memory_bytes: int | None = None,
                 read_device: Callable[[], DeviceMemory] = read_device_memory,
                 monitor: DeviceMonitor | None = None) -> None:
        self.planner = planner
        self.store = store
        self.reserve_bytes = reserve_bytes
        self.device_memory_bytes = device_memory_bytes  # configured budget; None = read device
        self.read_device = read_device
        self.monitor = monitor or DeviceMonitor()
        self.energy = EnergyMeter()
        self.engines: dict[str, EngineFigures] = {}
        self.started_s = time.monotonic()
        self._changed: dict[str, asyncio.Event] = {}  # per model: set when a version is issued
        self._closing = False

    def budget(self, requested_bytes: int) -> int:
        if requested_bytes > 0:
            return requested_bytes
        if self.device_memory_bytes is not None:
            return self.device_memory_bytes
        return self.read_device().free_bytes

    # -- plans ---------------------------------------------------------------------------------

    async def get_plan(self, request: PlanRequest) -> Plan:
        _check_shape(request.shape)
        if request.device_memory_bytes < 0 or request.reserved_bytes < 0:
            raise InvalidRequest("device_memory_bytes and reserved_bytes must be >= 0")
        if request.slots is not None and request.slots < 0:
            raise InvalidRequest(f"slots must be >= 0, got {request.slots}")
        budget = self.budget(request.device_memory_bytes)
        reserved = request.reserved_bytes or self.reserve_bytes
        before = self.planner.version(request.shape.fingerprint)
        counts = await self.store.counts(request.shape)
        plan = self.planner.plan(request.shape, counts, budget, reserved, slots=request.slots)
        self._notify_if_new(request.shape.fingerprint, before)
        if request.engine_id:
            figures = self._figures(request.engine_id, request.shape)
            self.engines[request.engine_id] = replace(
                figures, slots=plan.slots, device_memory_bytes=budget, reserved_bytes=reserved)
        log.info("plan v%d for engine %s, model %s: %s; pairs ranked by %s",
                 plan.version, request.engine_id or "(no id)", request.shape.fingerprint,
                 plan.size.log_line(), plan.source)
        return plan

    async def watch(self, request: PlanRequest, known_version: int = 0) -> AsyncIterator[Plan]:
        """The current plan unless its version is `known_version`, then each new version.
        Ends when the cache manager shuts down."""
        fingerprint = request.shape.fingerprint
        while not self._closing:
            changed = self._changed.setdefault(fingerprint, asyncio.Event())
            plan = await self.get_plan(request)
            if plan.version != known_version:  # != : a restarted cache manager counts anew
                known_version = plan.version
                yield plan
            if self.planner.version(fingerprint) == known_version:
                await changed.wait()

    def _notify_if_new(self, fingerprint: str, before: int) -> None:
        if self.planner.version(fingerprint) != before:
            event = self._changed.pop(fingerprint, None)
            if event is not None:
                event.set()

    def close_watches(self) -> None:
        """End every WatchPlans stream (at shutdown, so the server need not wait for them)."""
        self._closing = True
        for event in self._changed.values():
            event.set()
        self._changed.clear()

    async def refresh_models(self) -> None:
        """Fold fresh counts (other cache managers' too) and time decay into every model."""
        for shape in self.planner.shapes():
            before = self.planner.version(shape.fingerprint)
            self.planner.refresh(shape, await self.store.counts(shape),
                                 decode_totals=await self.store.counts(shape, phase=DECODE))
            self._notify_if_new(shape.fingerprint, before)

    # -- reports -------------------------------------------------------------------------------

    async def report(self, report: RoutingReport) -> int:
        """Take in one engine's report; returns the model's latest plan version."""
        if not report.engine_id:
            raise InvalidRequest("engine_id is empty; each engine reports under its own id")
        _check_shape(report.shape)
        d = report.decode
        negative = [f.name for f in fields(d) if f.name != "reasons" and getattr(d, f.name) < 0]
        if negative or report.tokens_generated < 0:
            raise InvalidRequest(f"{', '.join(negative or ['tokens_generated'])} must be >= 0")
        if d.hits > d.lookups:
            raise InvalidRequest(f"hits ({d.hits}) exceed lookups ({d.lookups})")
        fingerprint = report.shape.fingerprint
        if report.counts is not None and report.counts.any():
            await self.store.add(fingerprint, report.counts)
        if report.decode_counts is not None and report.decode_counts.any():
            await self.store.add(fingerprint, report.decode_counts, phase=DECODE)
        before = self.planner.version(fingerprint)
        counts = await self.store.counts(report.shape, fresh=False)  # the loop reads afresh
        decode = await self.store.counts(report.shape, fresh=False, phase=DECODE)
        version = self.planner.refresh(report.shape, counts, engine_slots=report.slots,
                                       decode_totals=decode)
        self._notify_if_new(fingerprint, before)
        figures = self._figures(report.engine_id, report.shape)
        if report.engine_id not in self.engines:
            log.info("engine %s reporting for model %s: %d slots (%.1f%% of %d pairs), "
                     "%s device memory", report.engine_id, fingerprint,
                     report.slots, 100 * report.slots / report.shape.total_pairs,
                     report.shape.total_pairs, format_bytes(report.device_memory_bytes))
        self.engines[report.engine_id] = _updated(figures, report, time.monotonic())
        return version

    def _figures(self, engine_id: str, shape: ModelShape) -> EngineFigures:
        figures = self.engines.get(engine_id)
        if figures is None or figures.fingerprint != shape.fingerprint:
            # New engine, or one that now serves another model: its totals start over.
            return EngineFigures(engine_id, shape.fingerprint, shape.total_pairs, shape.name)
        return figures

    def snapshot(self) -> list[EngineFigures]:
        return list(self.engines.values())

    # -- device --------------------------------------------------------------------------------

    def sample_device(self, now_s: float | None = None) -> DeviceSample:
        now_s = time.monotonic() if now_s is None else now_s
        sample = self.monitor.sample(now_s)
        self.energy.add(now_s, sample.energy_j, self.tokens_generated())
        return sample

    def device(self) -> DeviceSample:
        return self.monitor.latest or self.monitor.sample()

    def tokens_generated(self) -> int:
        return sum(e.tokens_generated for e in self.snapshot())


def _updated(figures: EngineFigures, report: RoutingReport, now_s: float) -> EngineFigures:
    changes: dict = {}
    d = report.decode
    if d.lookups:
        changes["latest"] = d
    if figures.reported_s:
        elapsed_s = now_s - figures.reported_s
        changes["tokens_per_s"] = report.tokens_generated / elapsed_s if elapsed_s > 0 else 0.0
    extra = report.extra
    if extra.link_bytes is not None and extra.link_busy_s:
        changes["link_bytes_per_s"] = extra.link_bytes / extra.link_busy_s
    if extra.requests_running is not None:
        changes["requests_running"] = extra.requests_running
    if extra.requests_waiting is not None:
        changes["requests_waiting"] = extra.requests_waiting
    return replace(
        figures, slots=report.slots, plan_version=report.plan_version, reported_s=now_s,
        model_name=report.shape.name or figures.model_name,
        # 0 = not said: keep what GetPlan resolved for this engine.
        device_memory_bytes=report.device_memory_bytes or figures.device_memory_bytes,
        reserved_bytes=report.reserved_bytes or figures.reserved_bytes,
        decode=_plus(figures.decode, d), tokens_generated=figures.tokens_generated + report.tokens_generated, **changes)


def _plus(a: CacheCounters, b: CacheCounters) -> CacheCounters:
    out = a.copy()
    out.add(b)
    return out


def _check_shape(shape: ModelShape) -> None:
    problems = shape.problems()
    if problems:
        raise InvalidRequest("; ".join(problems))


def counts_from_flat(values: list[int] | np.ndarray, shape: ModelShape) -> np.ndarray | None:
    """Row-major [layer][expert] counts -> [L, E]; None for an empty list."""
    if len(values) == 0:
        return None
    if len(values) != shape.total_pairs:
        raise InvalidRequest(f"counts has {len(values)} entries; the model has "
                             f"{shape.num_layers}x{shape.num_experts} = {shape.total_pairs} "
                             "pairs (row-major [layer][expert])")
    table = np.asarray(values, dtype=np.int64).reshape(shape.num_layers, shape.num_experts)
    if table.min() < 0:
        raise InvalidRequest("counts must be >= 0")
    return table
