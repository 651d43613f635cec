"""The live profile of one model: routed work per pair, decayed over time. Pure numpy.

    Redis totals (cumulative, every engine) ──observe(totals, now)──> delta since the last look
    scores = scores * 0.5 ** (elapsed / half_life) + delta          (an exponential moving sum)
    ranking = pairs by score, ties in `base_order` (the loaded profile's order, else layer order)

Decode tokens alone are kept the same way (`decode_scores`, decayed alike): they rank nothing,
but they are the distribution the decode hit rate is measured on, saved with the profile for the
capacity planner.

Drift of a pinned set P of size K, against the ideal set I (the K highest scores):

    drift = (score(I) - score(P)) / score(all)

the share of (decayed) routed work that P misses and the best K pairs would serve. It is 0 when P
is the best set, whatever the coverage, and unchanged by decay alone (decay scales every score).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.common.profile import Profile, fingerprint_key

SOURCE_COUNTS = "routing-counts"
SOURCE_PROFILE = "profile"
SOURCE_LAYER_ORDER = "layer-order"


@dataclass
class LiveProfile:
    num_layers: int
    num_experts: int
    half_life_s: float
    scores: np.ndarray  # [L*E] float64, decayed routed tokens
    base_order: np.ndarray  # [L*E] flat pair indices: tie-break order, hottest first
    source: str  # SOURCE_*: what the scores hold so far
    decode_scores: np.ndarray | None = None  # [L*E] decayed decode tokens; None: none seen yet
    _totals: np.ndarray | None = None  # [L*E] cumulative counts at the last observation
    _decode_totals: np.ndarray | None = None  # [L*E] the same for the decode counts
    _last_s: float = 0.0

    @classmethod
    def empty(cls, num_layers: int, num_experts: int, half_life_s: float) -> LiveProfile:
        n = num_layers * num_experts
        return cls(num_layers, num_experts, half_life_s, np.zeros(n), np.arange(n),
                   SOURCE_LAYER_ORDER)

    @classmethod
    def from_profile(cls, profile: Profile, half_life_s: float) -> LiveProfile:
        """Seeded from a saved profile: its counts are the decayed scores it was saved with."""
        scores = profile.counts().reshape(-1).astype(np.float64)
        decode = profile.decode_table()
        return cls(profile.num_layers, profile.num_experts, half_life_s, scores,
                   profile.order(), SOURCE_PROFILE,
                   None if decode is None else decode.reshape(-1).astype(np.float64))

    @property
    def total_pairs(self) -> int:
        return self.num_layers * self.num_experts

    def observe(self, totals: np.ndarray, now_s: float,
                decode_totals: np.ndarray | None = None) -> bool:
        """Fold in cumulative counts [L, E] seen at `now_s` (and their decode-phase share, when
        known); True when new work arrived."""
        totals = np.array(totals, dtype=np.int64).reshape(-1)  # [L*E], a copy: kept below
        assert totals.size == self.total_pairs, (totals.size, self.total_pairs)
        first = self._totals is None
        delta = self._delta(totals, self._totals)
        if not first:
            elapsed_s = max(0.0, now_s - self._last_s)
            if self.half_life_s > 0 and elapsed_s > 0:
                factor = 0.5 ** (elapsed_s / self.half_life_s)
                self.scores *= factor
                if self.decode_scores is not None:
                    self.decode_scores *= factor
        self._totals, self._last_s = totals, now_s
        if decode_totals is not None:
            decode_totals = np.array(decode_totals, dtype=np.int64).reshape(-1)  # [L*E]
            assert decode_totals.size == self.total_pairs
            decode_delta = self._delta(decode_totals, self._decode_totals)
            self._decode_totals = decode_totals
            if decode_delta.any():
                if self.decode_scores is None:
                    self.decode_scores = np.zeros(self.total_pairs)
                self.decode_scores += decode_delta
        if not delta.any():
            return False
        self.scores += delta
        self.source = SOURCE_COUNTS
        return True

    def _delta(self, totals: np.ndarray, last: np.ndarray | None) -> np.ndarray:
        if last is None:
            # First look. A loaded profile already holds the history in Redis (it was built
            # from it), so only later work is added; otherwise the history counts once.
            return np.zeros_like(totals) if self.source == SOURCE_PROFILE else totals
        # A count below the last one means Redis lost its data: what it has now is new.
        return np.where(totals >= last, totals - last, totals)

    def order(self) -> np.ndarray:
        """Flat pair indices, highest score first; equal scores keep `base_order`."""
        return self.base_order[np.argsort(-self.scores[self.base_order], kind="stable")]

    def to_profile(self, fingerprint: str, built_for_slots: int = 0) -> Profile:
        """Every pair, ranked; counts are the scores rounded (so they stay non-increasing)."""
        order = self.order()
        counts = np.rint(self.scores[order]).astype(np.int64)
        ranked = tuple(zip((order // self.num_experts).tolist(),
                           (order % self.num_experts).tolist(), counts.tolist(), strict=True))
        decode = (None if self.decode_scores is None
                  else tuple(np.rint(self.decode_scores[order]).astype(np.int64).tolist()))
        return Profile(fingerprint_key(fingerprint), self.num_layers, self.num_experts, ranked,
                       built_for_slots, decode)


def drift(scores: np.ndarray, pinned: np.ndarray, k: int) -> float:
    """Share of routed work the first `k` pinned pairs miss that the best `k` would serve."""
    n = scores.size
    total = float(scores.sum())
    if total <= 0 or k <= 0 or k >= n:
        return 0.0
    best = float(np.partition(scores, n - k)[n - k:].sum())
    held = float(scores[pinned[:k]].sum())
    return max(0.0, (best - held) / total)


def served_share(scores: np.ndarray, pinned: np.ndarray, k: int) -> float:
    """Share of routed work the first `k` pinned pairs serve (the profile's expected hit ratio)."""
    total = float(scores.sum())
    if total <= 0:
        return 0.0
    return float(scores[pinned[:k]].sum()) / total
