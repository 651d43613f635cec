"""Residency planning: routing counts + device budget -> plan. Pure: no grpc, no redis.

    device memory, reserved, slot_bytes ──size_cache──> slots
    routing counts [L, E] ─┐
    profile ranking ───────┼──rank──> pairs hottest first ──first `slots`──> Plan(version, ...)
    layer order ───────────┘

Ranking sources, best first: routing counts reported by engines ("routing-counts"), the expert
profile file ("profile"), layer order (0,0), (0,1), ... ("layer-order"). Pairs without counts keep
the order of the next source down, so early, sparse counts refine the profile rather than discard
it.

A model's plan version increases when its resident set could change: a different source, or a
different set of the top-`K` pairs, where K is the largest slot count handed out for the model
(the biggest cache any engine holds). Reordering inside that set, or below it, changes nothing
any engine keeps resident, so engines are not asked to re-fetch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from services.common.profile import Profile, ProfileError, rank_pairs
from services.common.sizing import CacheSize, size_cache

log = logging.getLogger("strata.cachemgr")

SOURCE_COUNTS = "routing-counts"
SOURCE_PROFILE = "profile"
SOURCE_LAYER_ORDER = "layer-order"
MAX_PAIRS = 1 << 24  # a bound on per-model tables; today's largest MoEs have ~10^5 pairs


@dataclass(frozen=True)
class ModelShape:
    fingerprint: str
    num_layers: int
    num_experts: int
    slot_bytes: int
    name: str = ""
    experts_per_token: int = 0

    @property
    def total_pairs(self) -> int:
        return self.num_layers * self.num_experts

    def problems(self) -> list[str]:
        """Why this shape cannot be planned for (empty when fine)."""
        out = []
        if not self.fingerprint:
            out.append("model.fingerprint is empty")
        if self.num_layers <= 0 or self.num_experts <= 0:
            out.append(f"model shape {self.num_layers}x{self.num_experts} (layers x experts) "
                       "must be positive")
        elif self.total_pairs > MAX_PAIRS:
            out.append(f"model has {self.total_pairs} pairs; at most {MAX_PAIRS} are supported")
        if self.slot_bytes <= 0:
            out.append(f"model.slot_bytes={self.slot_bytes} must be positive")
        return out


@dataclass(frozen=True)
class Ranking:
    source: str
    order: np.ndarray  # [L*E] flat pair indices (layer * E + expert), hottest first


@dataclass(frozen=True)
class Plan:
    version: int
    slots: int
    total_pairs: int
    pairs: tuple[tuple[int, int], ...]  # (layer, expert), hottest first, len == slots
    source: str
    size: CacheSize

    @property
    def coverage(self) -> float:
        return self.slots / self.total_pairs if self.total_pairs else 0.0


@dataclass
class _ModelState:
    version: int = 0
    key: tuple = ()
    watch_slots: int = 0  # largest slot count handed out for this model
    ranking: Ranking | None = None


@dataclass
class Planner:
    """Plans for every model seen; keeps each model's version. `profile` is optional."""

    profile: Profile | None = None
    _models: dict[str, _ModelState] = field(default_factory=dict)
    _profile_rejected: set[str] = field(default_factory=set)

    def rank(self, shape: ModelShape, counts: np.ndarray | None) -> Ranking:
        base, source = self._base_order(shape)
        if counts is not None and np.any(counts > 0):
            assert counts.shape == (shape.num_layers, shape.num_experts), counts.shape
            return Ranking(SOURCE_COUNTS, rank_pairs(counts, base))
        return Ranking(source, base)

    def _base_order(self, shape: ModelShape) -> tuple[np.ndarray, str]:
        if self.profile is not None and shape.fingerprint not in self._profile_rejected:
            try:
                self.profile.validate(shape.fingerprint, shape.num_layers, shape.num_experts)
                return self.profile.order(), SOURCE_PROFILE
            except ProfileError as exc:
                self._profile_rejected.add(shape.fingerprint)
                log.warning("ignoring the expert profile for model %s (%s): %s; plans for it "
                            "use routing counts or layer order", shape.fingerprint,
                            shape.name or "unnamed", exc)
        return np.arange(shape.total_pairs), SOURCE_LAYER_ORDER

    def refresh(self, shape: ModelShape, counts: np.ndarray | None,
                engine_slots: int = 0) -> int:
        """Re-rank the model from fresh counts; returns its (possibly bumped) plan version.

        engine_slots: the cache size of the engine asking, which may widen the watched set.
        """
        state = self._models.setdefault(shape.fingerprint, _ModelState())
        ranking = self.rank(shape, counts)
        key = _version_key(ranking, state.watch_slots or shape.total_pairs)
        if key != state.key:
            state.version += 1
            if state.version > 1:
                log.info("plan for model %s is now version %d (ranked by %s)",
                         shape.fingerprint, state.version, ranking.source)
        if engine_slots > state.watch_slots:
            # A bigger cache than any before: watch a wider set from now on (no bump for that).
            state.watch_slots = engine_slots
            key = _version_key(ranking, engine_slots)
        state.key = key
        state.ranking = ranking
        return state.version

    def plan(self, shape: ModelShape, counts: np.ndarray | None, device_memory_bytes: int,
             reserved_bytes: int) -> Plan:
        """The residency plan for one engine: slots from the budget, then the hottest pairs."""
        assert not shape.problems(), shape.problems()
        size = size_cache(device_memory_bytes, reserved_bytes, shape.slot_bytes,
                          shape.total_pairs)
        version = self.refresh(shape, counts, engine_slots=size.slots)
        state = self._models[shape.fingerprint]
        assert state.ranking is not None
        top = state.ranking.order[:size.slots]
        pairs = tuple(zip((top // shape.num_experts).tolist(), (top % shape.num_experts).tolist(),
                          strict=True))
        return Plan(version, size.slots, shape.total_pairs, pairs, state.ranking.source, size)

    def version(self, fingerprint: str) -> int:
        """The latest plan version of a model (0 if never planned)."""
        state = self._models.get(fingerprint)
        return state.version if state else 0

    def versions(self) -> dict[str, int]:
        # list() first: the metrics thread calls this while the event loop may add models.
        return {fp: s.version for fp, s in list(self._models.items())}


def _version_key(ranking: Ranking, watch_slots: int) -> tuple:
    return ranking.source, np.sort(ranking.order[:watch_slots]).tobytes()
