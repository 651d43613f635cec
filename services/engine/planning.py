"""Where the engine's residency plan comes from, and where its routing counts go.

Order of preference: the cache manager (GetPlan), else an expert-profile.bin, else layer order.
The cache manager is optional: when it is unreachable the engine logs it and keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np

from services.common import counters
from services.common.counters import CacheCounters
from services.common.pb.strata.v1 import cachemgr_pb2, cachemgr_pb2_grpc

log = logging.getLogger("strata.engine")


@dataclass(frozen=True)
class Plan:
    version: int
    slots: int
    pairs: tuple[tuple[int, int], ...]
    source: str


def local_plan(runner: object, profile_path: str | None) -> Plan:
    """Plan without a cache manager: the profile's ranking if one is given, else layer order."""
    if profile_path:
        from services.common.profile import Profile

        profile = Profile.read(profile_path)
        profile.validate(runner.fingerprint, runner.config.num_layers,  # type: ignore[attr-defined]
                         runner.config.num_experts)  # type: ignore[attr-defined]
        log.info("profile %s: %d ranked pairs, built for %d slots", profile_path,
                 len(profile.ranked), profile.built_for_slots)
        pairs = tuple((layer, expert) for layer, expert, _ in profile.ranked)
        return Plan(0, runner.slots, pairs, "profile")  # type: ignore[attr-defined]
    return Plan(0, runner.slots, tuple(runner.layer_order_pairs()),  # type: ignore[attr-defined]
                "layer-order")


class CacheManagerLink:
    """The engine's side of the CacheManager service."""

    def __init__(self, address: str, engine_id: str, runner: object):
        self.address = address
        self.engine_id = engine_id
        self.runner = runner
        size = runner.cache_size  # type: ignore[attr-defined]
        self.device_memory_bytes = size.limit_bytes  # the budget rule's terms, as sized
        self.reserved_bytes = size.reserved_bytes
        self.slots = size.slots
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = cachemgr_pb2_grpc.CacheManagerStub(self._channel)
        # The cache's lifetime decode counters, tokens and link totals at the last report.
        self._reported: tuple[CacheCounters, int, tuple[int, int, float]] = (
            CacheCounters(), 0, (0, 0, 0.0))
        self._failures = 0
        # (all, decode) counts of reports that could not be sent
        self._unsent: tuple[np.ndarray, np.ndarray] | None = None

    def shape(self) -> cachemgr_pb2.ModelShape:
        r = self.runner
        return cachemgr_pb2.ModelShape(
            fingerprint=r.fingerprint, name=r.model_name,  # type: ignore[attr-defined]
            num_layers=r.config.num_layers, num_experts=r.config.num_experts,  # type: ignore[attr-defined]
            experts_per_token=r.config.experts_per_token,  # type: ignore[attr-defined]
            slot_bytes=r.slot_bytes)  # type: ignore[attr-defined]

    async def get_plan(self, timeout_s: float = 10.0) -> Plan:
        reply = await self._stub.GetPlan(cachemgr_pb2.GetPlanRequest(
            engine_id=self.engine_id, model=self.shape(),
            device_memory_bytes=self.device_memory_bytes, reserved_bytes=self.reserved_bytes,
            slots=self.slots),
            timeout=timeout_s, wait_for_ready=True)
        return Plan(reply.version, reply.slots, tuple((p.layer, p.expert) for p in reply.pairs),
                    reply.source)

    async def report(self, totals: object, plan_version: int,
                     load: tuple[int, int] | None = None) -> int | None:
        """Send routing counts and cache figures since the last report (with the requests
        (running, waiting) now, when given); returns the cache manager's plan version, or None
        when it could not be reached (counts are kept)."""
        counts, decode = self.runner.take_phase_routing_counts()  # type: ignore[attr-defined]
        if self._unsent is not None:
            counts, decode = counts + self._unsent[0], decode + self._unsent[1]
            self._unsent = None
        cache = self.runner.cache  # type: ignore[attr-defined]
        cache_now, tokens_now = cache.decode.copy(), totals.tokens_generated  # type: ignore[attr-defined]
        link_now = cache.link.totals()  # (copies, bytes, busy seconds)
        cache_before, tokens_before, link_before = self._reported
        optional: dict[str, int | float] = {}
        busy_s = link_now[2] - link_before[2]
        if busy_s > 0:  # copies finished: a busy time to divide by
            optional |= {"link_bytes": link_now[1] - link_before[1], "link_busy_s": busy_s}
        if load is not None:
            optional |= {"requests_running": load[0], "requests_waiting": load[1]}
        try:
            ack = await self._stub.ReportRouting(cachemgr_pb2.RoutingReport(
                engine_id=self.engine_id, model=self.shape(), counts=counts.ravel().tolist(),
                decode_counts=decode.ravel().tolist(),
                decode=counters.to_proto(cache_now.since(cache_before)),
                tokens_generated=tokens_now - tokens_before,
                slots=self.runner.slots, device_memory_bytes=self.device_memory_bytes,  # type: ignore[attr-defined]
                reserved_bytes=self.reserved_bytes, plan_version=plan_version, **optional),
                timeout=5.0)
        except grpc.aio.AioRpcError as exc:
            self._unsent = (counts, decode)
            self._failures += 1
            if self._failures in (1, 10) or self._failures % 100 == 0:
                log.warning("cache manager at %s unreachable (%s, %d reports failed); routing "
                            "counts are kept and sent when it is back", self.address,
                            exc.code().name, self._failures)
            return None
        if self._failures:
            log.info("cache manager at %s is back after %d failed reports", self.address,
                     self._failures)
            self._failures = 0
        self._reported = (cache_now, tokens_now, link_now)
        return ack.plan_version

    async def report_forever(self, totals: object, plan_version: Callable[[], int],
                             interval_s: float,
                             load: Callable[[], tuple[int, int]] | None = None) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.report(totals, plan_version(), load() if load else None)

    async def close(self) -> None:
        await self._channel.close()
