"""The cache manager's state and operations, free of gRPC: plans for engines, routing reports,
and the per-engine figures the metrics read.

    GetPlan ──> budget (request | --device-memory | free device memory) ──> Planner.plan
    ReportRouting ──> store.add(counts) ──> Planner.refresh ──> plan version
                  └─> per-engine running totals (lookups, hits, spilled) ──> metrics, log summary
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from services.cachemgr.device import DeviceMemory, read_device_memory
from services.cachemgr.planner import ModelShape, Plan, Planner
from services.cachemgr.store import MemoryStore, RedisStore
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


@dataclass(frozen=True)
class RoutingReport:
    engine_id: str
    shape: ModelShape
    counts: np.ndarray | None  # [L, E] routed tokens per pair since the last report
    lookups: int
    hits: int
    spilled: int
    tokens_generated: int
    slots: int
    device_memory_bytes: int
    reserved_bytes: int
    plan_version: int


@dataclass(frozen=True)
class EngineFigures:
    """One engine as the cache manager last heard of it; lookups/hits/spilled are running totals."""

    engine_id: str
    fingerprint: str
    total_pairs: int
    slots: int = 0
    device_memory_bytes: int = 0
    reserved_bytes: int = 0
    plan_version: int = 0
    lookups: int = 0
    hits: int = 0
    spilled: int = 0
    tokens_generated: int = 0
    hit_ratio: float = 0.0  # over the latest report with lookups
    spill_ratio: float = 0.0  # spilled / lookups over the latest report with lookups

    @property
    def coverage(self) -> float:
        return self.slots / self.total_pairs if self.total_pairs else 0.0


class CacheManager:
    def __init__(self, planner: Planner, store: MemoryStore | RedisStore, reserve_bytes: int,
                 device_memory_bytes: int | None = None,
                 read_device: Callable[[], DeviceMemory] = read_device_memory) -> None:
        self.planner = planner
        self.store = store
        self.reserve_bytes = reserve_bytes
        self.device_memory_bytes = device_memory_bytes  # configured budget; None = read device
        self.read_device = read_device
        self.engines: dict[str, EngineFigures] = {}
        self.started_s = time.monotonic()

    def budget(self, requested_bytes: int) -> int:
        if requested_bytes > 0:
            return requested_bytes
        if self.device_memory_bytes is not None:
            return self.device_memory_bytes
        return self.read_device().free_bytes

    async def get_plan(self, request: PlanRequest) -> Plan:
        _check_shape(request.shape)
        if request.device_memory_bytes < 0 or request.reserved_bytes < 0:
            raise InvalidRequest("device_memory_bytes and reserved_bytes must be >= 0")
        budget = self.budget(request.device_memory_bytes)
        reserved = request.reserved_bytes or self.reserve_bytes
        counts = await self.store.counts(request.shape)
        plan = self.planner.plan(request.shape, counts, budget, reserved)
        if request.engine_id:
            figures = self._figures(request.engine_id, request.shape)
            self.engines[request.engine_id] = replace(
                figures, slots=plan.slots, device_memory_bytes=budget, reserved_bytes=reserved,
                plan_version=plan.version)
        log.info("plan v%d for engine %s, model %s: %s; pairs ranked by %s",
                 plan.version, request.engine_id or "(no id)", request.shape.fingerprint,
                 plan.size.log_line(), plan.source)
        return plan

    async def report(self, report: RoutingReport) -> int:
        """Take in one engine's report; returns the model's latest plan version."""
        if not report.engine_id:
            raise InvalidRequest("engine_id is empty; each engine reports under its own id")
        _check_shape(report.shape)
        if min(report.lookups, report.hits, report.spilled, report.tokens_generated) < 0:
            raise InvalidRequest("lookups, hits, spilled and tokens_generated must be >= 0")
        if report.hits > report.lookups:
            raise InvalidRequest(f"hits ({report.hits}) exceed lookups ({report.lookups})")
        if report.counts is not None and report.counts.any():
            await self.store.add(report.shape.fingerprint, report.counts)
        counts = await self.store.counts(report.shape, fresh=False)  # GetPlan reads afresh
        version = self.planner.refresh(report.shape, counts, engine_slots=report.slots)
        figures = self._figures(report.engine_id, report.shape)
        if report.engine_id not in self.engines:
            log.info("engine %s reporting for model %s: %d slots (%.1f%% of %d pairs), "
                     "%s device memory", report.engine_id, report.shape.fingerprint,
                     report.slots, 100 * report.slots / report.shape.total_pairs,
                     report.shape.total_pairs, format_bytes(report.device_memory_bytes))
        window = {}
        if report.lookups:
            window = {"hit_ratio": report.hits / report.lookups,
                      "spill_ratio": report.spilled / report.lookups}
        self.engines[report.engine_id] = replace(
            figures, slots=report.slots, plan_version=report.plan_version,
            # 0 = not said: keep what GetPlan resolved for this engine.
            device_memory_bytes=report.device_memory_bytes or figures.device_memory_bytes,
            reserved_bytes=report.reserved_bytes or figures.reserved_bytes,
            lookups=figures.lookups + report.lookups, hits=figures.hits + report.hits,
            spilled=figures.spilled + report.spilled,
            tokens_generated=figures.tokens_generated + report.tokens_generated, **window)
        return version

    def _figures(self, engine_id: str, shape: ModelShape) -> EngineFigures:
        figures = self.engines.get(engine_id)
        if figures is None or figures.fingerprint != shape.fingerprint:
            # New engine, or one that now serves another model: its totals start over.
            return EngineFigures(engine_id, shape.fingerprint, shape.total_pairs)
        return figures

    def snapshot(self) -> list[EngineFigures]:
        return list(self.engines.values())


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
