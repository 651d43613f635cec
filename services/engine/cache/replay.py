"""Offline replay of routing traces: the engine's own residency code, and the Belady (MIN)
oracle, over a recorded sequence of lookups. Pure Python + numpy.

`replay()` drives `Residency` exactly as the engine's ExpertCache does (same fills, same access
order, same prefetch admissions), so a trace replayed at the live size and policy reproduces the
live counters exactly. `belady()` is the offline optimum for the same size: on a miss with a full
cache it evicts the resident pair used again farthest in the future — or bypasses the missing
pair when that pair's own next use is farther still. It sees demand lookups only (no prefetch)
and is not bound by the pinned core.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.counters import CacheCounters
from services.engine.cache.policy import Pair, PolicySpec, Residency
from services.engine.cache.stats import PredictionTracker, count_phases
from services.engine.cache.trace import FILL, PREDICT, ROUTED_KINDS, Record

NEVER = 1 << 62


@dataclass
class ReplayResult:
    decode: CacheCounters
    prefill: CacheCounters
    evictions: int = 0


def replay(records: Sequence[Record], num_slots: int, spec: PolicySpec, *, prefetch: bool,
           fill: Sequence[Pair] | None = None) -> ReplayResult:
    """Replay `records` through a fresh Residency. `fill` overrides the trace's FILL records."""
    residency = Residency(num_slots, spec)
    predictions = PredictionTracker()
    result = ReplayResult(CacheCounters(), CacheCounters())
    if fill is not None:
        residency.plan_fill(fill)
    for r in records:
        if r.kind == FILL:
            if fill is None:
                residency.plan_fill(r.pairs())
            continue
        layer = r.layer
        if r.kind == PREDICT:
            experts = r.entries["expert"].tolist()
            predictions.predict(layer, experts)
            if prefetch:
                result.decode.prefetch_fills += len(residency.prefetch(layer, experts))
            continue
        phases = r.phase_counts()
        entries = [(e, d + p) for e, d, p in phases]
        outcomes = residency.access(layer, entries, prefill=[d == 0 for _, d, _ in phases])
        count_phases(result.decode, result.prefill, phases, outcomes)
        if any(d for _, d, _ in phases):
            predictions.routed(result.decode, layer, (e for e, d, _ in phases if d))
    result.evictions = residency.evictions
    return result


def belady(records: Sequence[Record], num_slots: int, fill: Sequence[Pair] | None = None
           ) -> ReplayResult:
    """Hits of the MIN oracle with `num_slots` slots, starting from the same pre-fill."""
    accesses: list[tuple[Pair, int, int]] = []  # (pair, decode tokens, prefill tokens)
    fills: dict[int, list[Pair]] = {}  # access index -> fill ranking applied before it
    for r in records:
        if r.kind == FILL and fill is None:
            fills[len(accesses)] = r.pairs()
        elif r.kind in ROUTED_KINDS:
            layer = r.layer
            accesses.extend(((layer, e), d, p) for e, d, p in r.phase_counts())
    if fill is not None:
        fills[0] = list(fill)
    next_use = [NEVER] * len(accesses)
    last: dict[Pair, int] = {}
    for i in range(len(accesses) - 1, -1, -1):
        pair = accesses[i][0]
        next_use[i] = last.get(pair, NEVER)
        last[pair] = i

    result = ReplayResult(CacheCounters(), CacheCounters())
    resident: dict[Pair, int] = {}  # pair -> index of its next use
    heap: list[tuple[int, Pair]] = []  # (-next use, pair), lazily cleaned
    for i, (pair, decode_n, prefill_n) in enumerate(accesses):
        if i in fills:
            resident, heap = _belady_fill(fills[i], num_slots, accesses, i)
        result.decode.lookups += decode_n
        result.prefill.lookups += prefill_n
        if pair in resident:
            result.decode.hits += decode_n
            result.prefill.hits += prefill_n
        elif num_slots == 0:
            continue
        elif len(resident) >= num_slots:
            while -heap[0][0] != resident.get(heap[0][1]):
                heapq.heappop(heap)  # stale
            far_use, victim = -heap[0][0], heap[0][1]
            if next_use[i] >= far_use:
                continue  # bypass: this pair is needed later than anything resident
            heapq.heappop(heap)
            del resident[victim]
            result.evictions += 1
        if num_slots:
            resident[pair] = next_use[i]
            heapq.heappush(heap, (-next_use[i], pair))
    return result


def _belady_fill(ranking: Sequence[Pair], num_slots: int, accesses: list[tuple[Pair, int, int]],
                 start: int) -> tuple[dict[Pair, int], list[tuple[int, Pair]]]:
    chosen: list[Pair] = []
    wanted: set[Pair] = set()
    for pair in ranking:
        pair = (int(pair[0]), int(pair[1]))
        if len(chosen) == num_slots:
            break
        if pair not in wanted:
            chosen.append(pair)
            wanted.add(pair)
    nxt: dict[Pair, int] = {}
    for i in range(start, len(accesses)):
        pair = accesses[i][0]
        if pair in wanted and pair not in nxt:
            nxt[pair] = i
            if len(nxt) == len(wanted):
                break
    resident = {pair: nxt.get(pair, NEVER) for pair in chosen}
    heap = [(-use, pair) for pair, use in resident.items()]
    heapq.heapify(heap)
    return resident, heap
