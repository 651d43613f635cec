"""The capacity planner: device memory -> slots -> coverage -> expected hit rate -> decode tok/s.

    free bytes ──size_cache──> slots, cache GiB, coverage                      (exact arithmetic)
    slots ──HitRateModel──> expected hit rate     (a routing trace replayed through the cache
                                                   policy, else the profile's decode CDF, else
                                                   measured points)
    hit rate ──CostModel──> decode tok/s          (fitted by `strata plan fit` on bench results;
    (cache work)                                   with a replay, on the slot fills (CPU) or the
                                                   misses + slot fills per decode lookup)

and the inverse: target tok/s -> the least slots (and device memory) that reach it.

Every number carries a basis: "measured" (exact arithmetic on the inputs, or read from a bench
result at this very size), "replayed" (a recorded routing trace run through the engine's own
residency code at this size), "fitted" (a model inside the range of the data it was built from)
or "extrapolated" (a model outside that range). `basis.hit_rate_source` names the hit-rate model
("replayed", "profile" or "measured").
"""

from __future__ import annotations

import gzip
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.common.profile import Profile
from services.common.sizing import size_cache
from services.engine.cache.policy import (
    DEFAULT_ADMIT_PREFILL,
    DEFAULT_CRF_LAMBDA,
    DEFAULT_PINNED_FRACTION,
    DEFAULT_POLICY,
    DEFAULT_PREFETCH,
    Pair,
    PolicySpec,
)
from services.engine.cache.replay import replay
from services.engine.cache.trace import Record, Trace

MIB = 2**20
GIB = 2**30
MEASURED, REPLAYED, FITTED, EXTRAPOLATED = "measured", "replayed", "fitted", "extrapolated"
LINEAR, CONSTANT = "linear", "constant"  # CostModel forms
# CostModel drivers, per decode lookup: misses, misses + slot fills, or slot fills alone
MISS, WORK, FILL = "miss", "work", "fill"


@dataclass(frozen=True)
class HitRateModel:
    """The seam for hit-rate sources: `hit_rate(slots)` and how that number was obtained."""

    source: str  # "replayed" | "profile" | "measured"
    hit_rate: Callable[[int], float]
    basis: Callable[[int], str]
    detail: str = ""  # one line on what the model rests on, copied into each row's basis
    expensive: bool = False  # each new slot count costs a replay: plan_inverse bisects
    # Cache work at a slot count: (misses, slot fills on demand and by prefetch) per decode
    # lookup; None when the source cannot tell (only a replay runs the dynamic policy's fills).
    work: Callable[[int], CacheWork] | None = None


def profile_hit_rate(profile: Profile) -> HitRateModel:
    """Expected decode hit rate of a cache holding the profile's hottest `slots` pairs: the share
    of decode lookups those pairs received (the profile's cumulative distribution, in its ranking
    order). A profile without decode counts (format version 1) falls back to all routed tokens,
    prompts included, which overstates the mass of pairs that prompts favour."""
    decode = profile.decode_counts is not None and sum(profile.decode_counts) > 0
    counts = np.array(profile.decode_counts if decode else
                      [count for _, _, count in profile.ranked], dtype=np.float64)
    total = counts.sum()
    cumulative = np.concatenate([[0.0], np.cumsum(counts)]) / total if total else None

    def hit_rate(slots: int) -> float:
        if cumulative is None:
            return min(1.0, slots / profile.total_pairs)  # no counts: uniform routing
        return float(cumulative[min(max(slots, 0), len(cumulative) - 1)])

    detail = ("decode routing counts" if decode else
              "all routed tokens (the profile has no decode counts)")
    return HitRateModel("profile", hit_rate, lambda slots: FITTED, detail)


def replayed_hit_rate(records: Sequence[Record], spec: PolicySpec, *, prefetch: bool,
                      fill: Sequence[Pair] | None = None, label: str = "") -> HitRateModel:
    """Decode hit rate of the recorded routing replayed through the engine's residency code
    (pinned core + dynamic region, `spec`) at each slot count, starting from `fill` (else the
    trace's own pre-fill records). Replays are memoized per slot count."""
    memo: dict[int, tuple[float, CacheWork]] = {}  # slots -> (hit rate, cache work)

    def run(slots: int) -> tuple[float, CacheWork]:
        slots = max(int(slots), 0)
        if slots not in memo:
            r = replay(records, slots, spec, prefetch=prefetch, fill=fill)
            memo[slots] = (r.decode.hit_rate, cache_work(
                r.decode.lookups, r.decode.hits, r.decode.fills + r.prefill.fills,
                r.decode.prefetch_fills))
        return memo[slots]

    detail = (f"trace {label} replayed" if label else "trace replayed") + (
        f" through policy {spec.label}{' + prefetch' if prefetch else ''}")
    return HitRateModel(REPLAYED, lambda slots: run(slots)[0], lambda slots: REPLAYED, detail,
                        expensive=True, work=lambda slots: run(slots)[1])


@dataclass(frozen=True)
class CacheWork:
    """The cache's own work per decode lookup, beyond the expert math it serves."""

    misses: float
    fills: float  # slot fills, on demand and by prefetch

    def value(self, driver: str) -> float:
        return self.fills if driver == FILL else self.misses + self.fills


def cache_work(lookups: int, hits: int, demand_fills: int, prefetch_fills: int) -> CacheWork:
    """Misses and slot fills per decode lookup. A fill is a slot copy plus the policy's
    bookkeeping; what a miss costs depends on the device (see `fit_driver`)."""
    if not lookups:
        return CacheWork(0.0, 0.0)
    return CacheWork((lookups - hits) / lookups, (demand_fills + prefetch_fills) / lookups)


def fit_driver(device: str | None, has_fill_counters: bool) -> str:
    """What decode time is fitted against. On a CPU a miss is read in place by the same
    kernel at the speed of a hit, so only the fills cost ("fill"); elsewhere a miss crosses
    the link, so misses and fills both do ("work"); without fill counters, the miss rate."""
    if not has_fill_counters:
        return MISS
    return FILL if device == "cpu" else WORK


def read_trace(path: str | Path) -> Trace:
    """A routing trace, gzip-compressed when its name ends in .gz (traces compress ~17x)."""
    path = Path(path)
    if path.suffix != ".gz":
        return Trace.read(path)
    with gzip.open(path, "rb") as f:
        return Trace.from_bytes(f.read(), source=str(path))


def trace_hit_rate(trace: Trace, fill: Sequence[Pair] | None = None, label: str = "",
                   spec: PolicySpec | None = None, prefetch: bool | None = None) -> HitRateModel:
    """`replayed_hit_rate` with the policy and prefetch setting the trace was recorded with
    (the engine's defaults where its metadata is silent) unless given."""
    meta = trace.meta
    spec = spec or PolicySpec(str(meta.get("policy", DEFAULT_POLICY)),
                              float(meta.get("pinned_fraction", DEFAULT_PINNED_FRACTION)),
                              float(meta.get("crf_lambda", DEFAULT_CRF_LAMBDA)),
                              bool(meta.get("admit_prefill", DEFAULT_ADMIT_PREFILL)))
    prefetch = bool(meta.get("prefetch", DEFAULT_PREFETCH)) if prefetch is None else prefetch
    return replayed_hit_rate(trace.records, spec, prefetch=prefetch, fill=fill, label=label)


def measured_hit_rate(points: Sequence[tuple[int, float]], total_pairs: int) -> HitRateModel:
    """Piecewise-linear in slots through measured (slots, hit rate) points, anchored at
    (0, 0) and (total_pairs, 1); outside the measured range it leans on an anchor."""
    assert points and total_pairs > 0
    by_slots: dict[int, list[float]] = {}
    for slots, rate in points:
        by_slots.setdefault(int(slots), []).append(rate)
    measured = sorted((s, float(np.median(r))) for s, r in by_slots.items())
    xs = [s for s, _ in measured]
    anchors = ([(0, 0.0)] if xs[0] > 0 else []) + measured + (
        [(total_pairs, 1.0)] if xs[-1] < total_pairs else [])
    ax, ay = [a for a, _ in anchors], [b for _, b in anchors]

    def hit_rate(slots: int) -> float:
        return float(np.interp(slots, ax, ay))

    def basis(slots: int) -> str:
        if slots in by_slots:
            return MEASURED
        return FITTED if xs[0] <= slots <= xs[-1] else EXTRAPOLATED

    return HitRateModel("measured", hit_rate, basis)


@dataclass(frozen=True)
class CostModel:
    """Decode seconds per token = base + per_miss * x, fitted on bench results, where x (the
    driver) is the miss rate, or, when the fit had the engine's fill counters, the cache work
    per decode lookup (see `cache_work`, `fit_driver`): slot fills on a CPU, misses + slot
    fills on a GPU.

    Misses, not hits, drive decode speed behind a link (design.md section 1), so the model is
    linear in them ("linear"). A dynamic cache also pays for the fills that keep its hit rate
    up, which the miss rate alone cannot see: at 6% coverage a CRF region misses more but fills
    less than at 20%. Where the data show no significant cost the fit keeps a constant instead
    ("constant": per_miss_s = 0).
    """

    base_s: float
    per_miss_s: float  # seconds per token per unit of the driver
    miss_lo: float  # range of the driver the fit saw
    miss_hi: float
    form: str = LINEAR
    driver: str = MISS

    def driver_value(self, hit_rate: float, work: CacheWork | None = None) -> float:
        """x for this model: the cache work when it is driven by it and known; else what a
        static cache (it never fills) would do: its misses, and no fills."""
        if self.driver in (WORK, FILL) and work is not None:
            return work.value(self.driver)
        return 0.0 if self.driver == FILL else 1.0 - min(max(hit_rate, 0.0), 1.0)

    def decode_tok_s(self, hit_rate: float, work: CacheWork | None = None) -> float:
        per_token_s = self.base_s + max(self.per_miss_s, 0.0) * self.driver_value(hit_rate, work)
        return 1.0 / per_token_s if per_token_s > 0 else math.inf

    def basis(self, hit_rate: float, work: CacheWork | None = None) -> str:
        if self.driver in (WORK, FILL) and work is None and self.per_miss_s > 0:
            return EXTRAPOLATED  # a static cache standing in for the work it was fitted on
        x = self.driver_value(hit_rate, work)
        inside = self.miss_lo - 1e-9 <= x <= self.miss_hi + 1e-9
        return FITTED if inside else EXTRAPOLATED

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        return cls(d["base_s"], d["per_miss_s"], d["miss_lo"], d["miss_hi"],
                   d.get("model", LINEAR), d.get("driver", MISS))


@dataclass(frozen=True)
class Hardware:
    """What the arithmetic needs: the model's slot size and pair count, and the budget rule's
    other terms (services/common/sizing.py): the memory kept aside."""

    slot_bytes: int
    total_pairs: int
    reserved_bytes: int = 700 * MIB
    draft_bytes: int = 0
    weight_bytes: int = 0  # non-expert weights on the device
    kv_bytes: int = 0  # the KV pool

    @property
    def overhead_bytes(self) -> int:
        """Device memory taken before the first slot."""
        return self.reserved_bytes + self.draft_bytes + self.weight_bytes + self.kv_bytes


def plan_row(hw: Hardware, free_bytes: int, hits: HitRateModel | None,
             cost: CostModel | None) -> dict:
    size = size_cache(free_bytes, hw.reserved_bytes, hw.slot_bytes, hw.total_pairs,
                      draft_head_bytes=hw.draft_bytes, weight_bytes=hw.weight_bytes,
                      kv_bytes=hw.kv_bytes)
    basis = {"slots": MEASURED, "cache_gib": MEASURED, "coverage": MEASURED,
             "hit_rate": None, "decode_tok_s": None}
    hit_rate = decode = None
    if hits is not None:
        hit_rate = hits.hit_rate(size.slots)
        basis["hit_rate"] = hits.basis(size.slots)
        basis["hit_rate_source"] = hits.source
        if hits.detail:
            basis["hit_rate_detail"] = hits.detail
        if cost is not None:
            work = hits.work(size.slots) if hits.work is not None else None
            decode = cost.decode_tok_s(hit_rate, work)
            worse = EXTRAPOLATED in (basis["hit_rate"], cost.basis(hit_rate, work))
            basis["decode_tok_s"] = EXTRAPOLATED if worse else FITTED
            basis["decode_model"] = cost.form
            basis["decode_driver"] = (cost.driver if cost.driver != WORK or work is not None
                                      else MISS)
    return {"free_mib": round(free_bytes / MIB, 3), "slots": size.slots,
            "cache_gib": round(size.cache_bytes / GIB, 4), "coverage": round(size.coverage, 6),
            "hit_rate": None if hit_rate is None else round(hit_rate, 6),
            "decode_tok_s": None if decode is None else round(decode, 3), "basis": basis}


def default_free_sizes(hw: Hardware, steps: int = 10) -> list[int]:
    """Device memory sizes giving 1/steps, 2/steps, ... of full coverage."""
    return [hw.overhead_bytes + math.ceil(hw.total_pairs * k / steps) * hw.slot_bytes
            for k in range(1, steps + 1)]


def plan_table(hw: Hardware, free_bytes: Sequence[int], hits: HitRateModel | None = None,
               cost: CostModel | None = None) -> list[dict]:
    return [plan_row(hw, b, hits, cost) for b in free_bytes]


def plan_inverse(hw: Hardware, target_tok_s: float, hits: HitRateModel,
                 cost: CostModel) -> dict:
    """The least slots whose expected decode tok/s reaches the target, and the device memory
    that buys exactly them: the overhead (reserve, draft, weights, KV) + slots * slot_bytes. An expensive hit-rate model
    (trace replay) is searched on a coarse grid, then bisected inside the first grid interval
    that reaches the target (speed need not rise with slots: on a CPU a small dynamic region
    can decode faster than a larger one that fills more); others are scanned."""
    def speed(slots: int) -> float:
        work = hits.work(slots) if hits.work is not None else None
        return cost.decode_tok_s(hits.hit_rate(slots), work)

    found = _least_slots(speed, target_tok_s, hw.total_pairs) if hits.expensive else next(
        (s for s in range(hw.total_pairs + 1) if speed(s) >= target_tok_s), None)
    if found is not None:
        free_bytes = hw.overhead_bytes + found * hw.slot_bytes
        row = plan_row(hw, free_bytes, hits, cost)
        return {"target_tok_s": target_tok_s, "reachable": True, "free_bytes": free_bytes,
                **row}
    candidates = [hw.total_pairs] if hits.expensive else range(hw.total_pairs + 1)
    best_slots = max(candidates, key=lambda s: (speed(s), -s))
    best_speed = speed(best_slots)
    return {"target_tok_s": target_tok_s, "reachable": False,
            "best_decode_tok_s": round(best_speed, 3), "best_slots": best_slots,
            "basis": {"best_decode_tok_s": EXTRAPOLATED}}


def _least_slots(speed: Callable[[int], float], target: float, hi: int, grid: int = 16
                 ) -> int | None:
    """The least slots in 0..hi with speed >= target: the first of `grid` + 1 evenly spaced
    sizes that reaches it, then bisection between it and the size before (speed taken as
    non-decreasing within one grid interval)."""
    sizes = sorted({round(hi * k / grid) for k in range(grid + 1)})
    below = -1
    for size in sizes:
        if speed(size) >= target:
            lo, top = below + 1, size
            while lo < top:
                mid = (lo + top) // 2
                if speed(mid) >= target:
                    top = mid
                else:
                    lo = mid + 1
            return lo
        below = size
    return None
