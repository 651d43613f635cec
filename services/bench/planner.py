"""The capacity planner: device memory -> slots -> coverage -> expected hit rate -> decode tok/s.

    free bytes ──size_cache──> slots, cache GiB, coverage                      (exact arithmetic)
    slots ──HitRateModel──> expected hit rate     (profile CDF, or measured points; trace later)
    hit rate ──CostModel──> decode tok/s          (fitted by `strata plan fit` on bench results)

and the inverse: target tok/s -> the least slots (and device memory) that reach it.

Every number carries a basis: "measured" (exact arithmetic on the inputs, or read from a bench
result at this very size), "fitted" (a model inside the range of the data it was built from) or
"extrapolated" (a model outside that range).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from services.common.profile import Profile
from services.common.sizing import size_cache

MIB = 2**20
GIB = 2**30
MEASURED, FITTED, EXTRAPOLATED = "measured", "fitted", "extrapolated"


@dataclass(frozen=True)
class HitRateModel:
    """The seam for hit-rate sources: `hit_rate(slots)` and how that number was obtained.

    The cache engineer's trace replay plugs in here as one more constructor (replaying a
    recorded routing trace through the cache policy at each slot count).
    """

    source: str  # "profile" | "measured" | "trace"
    hit_rate: Callable[[int], float]
    basis: Callable[[int], str]


def profile_hit_rate(profile: Profile) -> HitRateModel:
    """Expected hit rate of a cache holding the profile's hottest `slots` pairs: the share of
    routed lookups those pairs received (the profile's cumulative distribution)."""
    counts = np.array([count for _, _, count in profile.ranked], dtype=np.float64)
    total = counts.sum()
    cumulative = np.concatenate([[0.0], np.cumsum(counts)]) / total if total else None

    def hit_rate(slots: int) -> float:
        if cumulative is None:
            return min(1.0, slots / profile.total_pairs)  # no counts: uniform routing
        return float(cumulative[min(max(slots, 0), len(cumulative) - 1)])

    return HitRateModel("profile", hit_rate, lambda slots: FITTED)


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
    """Decode seconds per token = base + per_miss * miss rate, fitted on bench results.

    Misses, not hits, drive decode speed (design.md section 1), so the model is linear in the
    miss rate; on a device that computes misses as fast as hits `per_miss_s` comes out ~0.
    """

    base_s: float
    per_miss_s: float
    miss_lo: float  # range of miss rates the fit saw
    miss_hi: float

    def decode_tok_s(self, hit_rate: float) -> float:
        per_token_s = self.base_s + self.per_miss_s * (1.0 - hit_rate)
        return 1.0 / per_token_s if per_token_s > 0 else math.inf

    def basis(self, hit_rate: float) -> str:
        miss = 1.0 - hit_rate
        inside = self.miss_lo - 1e-9 <= miss <= self.miss_hi + 1e-9
        return FITTED if inside else EXTRAPOLATED

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        return cls(d["base_s"], d["per_miss_s"], d["miss_lo"], d["miss_hi"])


@dataclass(frozen=True)
class Hardware:
    """What the arithmetic needs: the model's slot size and pair count, the memory kept aside."""

    slot_bytes: int
    total_pairs: int
    reserved_bytes: int = 700 * MIB
    draft_bytes: int = 0


def plan_row(hw: Hardware, free_bytes: int, hits: HitRateModel | None,
             cost: CostModel | None) -> dict:
    size = size_cache(free_bytes, hw.reserved_bytes, hw.slot_bytes, hw.total_pairs,
                      draft_head_bytes=hw.draft_bytes)
    basis = {"slots": MEASURED, "cache_gib": MEASURED, "coverage": MEASURED,
             "hit_rate": None, "decode_tok_s": None}
    hit_rate = decode = None
    if hits is not None:
        hit_rate = hits.hit_rate(size.slots)
        basis["hit_rate"] = hits.basis(size.slots)
        basis["hit_rate_source"] = hits.source
        if cost is not None:
            decode = cost.decode_tok_s(hit_rate)
            worse = EXTRAPOLATED in (basis["hit_rate"], cost.basis(hit_rate))
            basis["decode_tok_s"] = EXTRAPOLATED if worse else FITTED
    return {"free_mib": round(free_bytes / MIB, 3), "slots": size.slots,
            "cache_gib": round(size.cache_bytes / GIB, 4), "coverage": round(size.coverage, 6),
            "hit_rate": None if hit_rate is None else round(hit_rate, 6),
            "decode_tok_s": None if decode is None else round(decode, 3), "basis": basis}


def default_free_sizes(hw: Hardware, steps: int = 10) -> list[int]:
    """Device memory sizes giving 1/steps, 2/steps, ... of full coverage."""
    overhead = hw.reserved_bytes + hw.draft_bytes
    return [overhead + math.ceil(hw.total_pairs * k / steps) * hw.slot_bytes
            for k in range(1, steps + 1)]


def plan_table(hw: Hardware, free_bytes: Sequence[int], hits: HitRateModel | None = None,
               cost: CostModel | None = None) -> list[dict]:
    return [plan_row(hw, b, hits, cost) for b in free_bytes]


def plan_inverse(hw: Hardware, target_tok_s: float, hits: HitRateModel,
                 cost: CostModel) -> dict:
    """The least slots whose expected decode tok/s reaches the target, and the device memory
    that buys exactly them: reserved + draft + slots * slot_bytes."""
    best_slots, best_speed = 0, -math.inf
    for slots in range(hw.total_pairs + 1):
        speed = cost.decode_tok_s(hits.hit_rate(slots))
        if speed >= target_tok_s:
            free_bytes = hw.reserved_bytes + hw.draft_bytes + slots * hw.slot_bytes
            row = plan_row(hw, free_bytes, hits, cost)
            return {"target_tok_s": target_tok_s, "reachable": True,
                    "free_bytes": free_bytes, **row}
        if speed > best_speed:
            best_slots, best_speed = slots, speed
    return {"target_tok_s": target_tok_s, "reachable": False,
            "best_decode_tok_s": round(best_speed, 3), "best_slots": best_slots,
            "basis": {"best_decode_tok_s": EXTRAPOLATED}}
