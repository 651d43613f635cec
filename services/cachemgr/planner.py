"""Residency planning: live profile + device budget -> versioned plan. Pure: no grpc, no redis.

    device memory, reserved, slot_bytes ──size_cache──> slots
    routing totals ──LiveProfile (decayed)──> ranking ──┐
    profile file (seeds the scores, breaks ties) ───────┤
    layer order (0,0), (0,1), ... (last resort) ────────┘
    ranking ──(issue a version)──> pinned order ──first `slots`──> Plan(version, ...)

A version names one pinned order: every plan of version N hands out a prefix of the same order.
The first version is issued when an engine first holds a plan of the model. After that, versions
follow drift events (drift: see `live.drift`; K is the largest slot count handed out for the
model, the biggest cache any engine holds):

    drift >= replan_drift         the event opens; the best set so far is its candidate
    candidate moves by >= half    (drift of the candidate itself >= replan_drift / 2) it is
      the threshold                 replaced and the settling clock restarts
    candidate settled for         one version is issued, pinned to the current ranking; drift
      replan_settle_s               restarts from zero
    drift < replan_drift / 2      the event closes without a version (hysteresis)

so a shift of the workload, which moves the decayed ranking over several looks, yields one
version once the new hot set has emerged, not one per look. Evaluations happen at every report
and every loop tick, so settling takes at least two of them. A pinned order that came from a
profile file or layer order is replaced at once when counts show it is worse by the threshold.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from services.cachemgr.live import (
    SOURCE_COUNTS,
    SOURCE_LAYER_ORDER,
    SOURCE_PROFILE,
    LiveProfile,
    drift,
    served_share,
)
from services.common.profile import Profile, ProfileError, fingerprint_key
from services.common.sizing import CacheSize, size_cache

log = logging.getLogger("strata.cachemgr")

__all__ = ["SOURCE_COUNTS", "SOURCE_LAYER_ORDER", "SOURCE_PROFILE", "ModelShape", "ModelStatus",
           "Plan", "Planner"]

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
class Plan:
    version: int
    slots: int
    total_pairs: int
    pairs: tuple[tuple[int, int], ...]  # (layer, expert), hottest first, len == slots
    source: str
    size: CacheSize
    reason: str = ""

    @property
    def coverage(self) -> float:
        return self.slots / self.total_pairs if self.total_pairs else 0.0


@dataclass(frozen=True)
class ModelStatus:
    """One model as the planner sees it (for metrics and the overview)."""

    fingerprint: str
    name: str
    version: int
    source: str  # of the pinned order
    drift: float
    watch_slots: int
    served_share: float  # share of decayed routed work the pinned set serves at watch_slots


@dataclass
class _ModelState:
    shape: ModelShape
    live: LiveProfile
    version: int = 0
    pinned: np.ndarray | None = None  # [L*E] the order of the current version
    pinned_source: str = ""
    reason: str = ""
    issued_s: float = 0.0
    watch_slots: int = 0  # largest slot count handed out for this model
    drift: float = 0.0
    candidate: np.ndarray | None = None  # best order of the open drift event (None: no event)
    candidate_s: float = 0.0  # when the candidate last moved
    dirty: bool = False  # scores changed since the profile was last saved


@dataclass
class Planner:
    """Plans for every model seen; keeps each model's live profile and plan version."""

    profiles: Iterable[Profile] | Profile | None = None
    half_life_s: float = 600.0
    replan_drift: float = 0.02
    replan_settle_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    _models: dict[str, _ModelState] = field(default_factory=dict)
    _files: dict[str, Profile] = field(default_factory=dict)

    def __post_init__(self) -> None:
        profiles = self.profiles
        if isinstance(profiles, Profile):
            profiles = [profiles]
        self._files = {p.fingerprint: p for p in profiles or ()}

    def _state(self, shape: ModelShape) -> _ModelState:
        state = self._models.get(shape.fingerprint)
        if state is not None:
            return state
        live = LiveProfile.empty(shape.num_layers, shape.num_experts, self.half_life_s)
        profile = self._files.get(fingerprint_key(shape.fingerprint))
        if profile is not None:
            try:
                profile.validate(shape.fingerprint, shape.num_layers, shape.num_experts)
                live = LiveProfile.from_profile(profile, self.half_life_s)
            except ProfileError as exc:
                log.warning("ignoring the expert profile for model %s (%s): %s; plans for it "
                            "use routing counts or layer order", shape.fingerprint,
                            shape.name or "unnamed", exc)
        elif self._files:
            log.warning("no expert profile for model %s (%s) among those loaded (%s); plans for "
                        "it use routing counts or layer order", shape.fingerprint,
                        shape.name or "unnamed", ", ".join(sorted(self._files)))
        state = self._models[shape.fingerprint] = _ModelState(shape, live)
        return state

    def refresh(self, shape: ModelShape, totals: np.ndarray | None, engine_slots: int = 0,
                now_s: float | None = None, decode_totals: np.ndarray | None = None) -> int:
        """Fold in the model's cumulative routing counts [L, E] (None: none read), their decode
        share when known, and an engine's cache size; returns the model's plan version, new
        when drift called for one."""
        now_s = self.clock() if now_s is None else now_s
        state = self._state(shape)
        if totals is not None and totals.size and state.live.observe(totals, now_s,
                                                                     decode_totals):
            state.dirty = True
        state.watch_slots = max(state.watch_slots, engine_slots)
        self._evaluate(state, now_s)
        return state.version

    def _evaluate(self, state: _ModelState, now_s: float) -> None:
        k = state.watch_slots
        if k <= 0:
            return  # no engine holds a plan of this model yet
        if state.pinned is None:
            self._issue(state, now_s, "first plan")
            return
        scores = state.live.scores
        state.drift = drift(scores, state.pinned, k)
        if state.candidate is None:
            if state.drift <= 0 or state.drift < self.replan_drift:
                return
            state.candidate, state.candidate_s = state.live.order(), now_s  # the event opens
        elif state.drift < self.replan_drift / 2:
            state.candidate = None  # it closes: the pinned set is good enough again
            return
        elif drift(scores, state.candidate, k) >= self.replan_drift / 2:
            state.candidate, state.candidate_s = state.live.order(), now_s  # still moving
        settled = state.candidate_s < now_s and now_s - state.candidate_s >= self.replan_settle_s
        if settled or state.pinned_source != SOURCE_COUNTS:
            self._issue(state, now_s, f"drift {state.drift:.1%} >= {self.replan_drift:.1%}")

    def _issue(self, state: _ModelState, now_s: float, reason: str) -> None:
        state.version += 1
        state.pinned = state.live.order()
        state.pinned_source = state.live.source
        state.reason, state.issued_s = reason, now_s
        state.drift, state.candidate = 0.0, None
        if state.version > 1:
            log.info("plan for model %s is now version %d (%s; ranked by %s)",
                     state.shape.fingerprint, state.version, reason, state.pinned_source)

    def plan(self, shape: ModelShape, totals: np.ndarray | None, device_memory_bytes: int,
             reserved_bytes: int, slots: int | None = None) -> Plan:
        """The residency plan for one engine: its slot count (the engine's own, sized by the
        budget rule after its weights and KV; else from the budget alone), then the pinned
        pairs."""
        assert not shape.problems(), shape.problems()
        size = size_cache(device_memory_bytes, reserved_bytes, shape.slot_bytes,
                          shape.total_pairs, slots=slots, how="engine")
        state = self._state(shape)
        self.refresh(shape, totals, engine_slots=size.slots)
        if state.pinned is None:  # a cache of 0 slots still holds a plan
            self._issue(state, self.clock(), "first plan")
            assert state.pinned is not None
        top = state.pinned[:size.slots]
        pairs = tuple(zip((top // shape.num_experts).tolist(), (top % shape.num_experts).tolist(),
                          strict=True))
        return Plan(state.version, size.slots, shape.total_pairs, pairs, state.pinned_source,
                    size, state.reason)

    def version(self, fingerprint: str) -> int:
        """The latest plan version of a model (0 if never planned)."""
        state = self._models.get(fingerprint)
        return state.version if state else 0

    def versions(self) -> dict[str, int]:
        # list() first: the metrics thread calls this while the event loop may add models.
        return {fp: s.version for fp, s in list(self._models.items())}

    def shapes(self) -> list[ModelShape]:
        return [s.shape for s in list(self._models.values())]

    def status(self) -> list[ModelStatus]:
        out = []
        for fp, s in list(self._models.items()):
            share = (served_share(s.live.scores, s.pinned, s.watch_slots)
                     if s.pinned is not None else 0.0)
            out.append(ModelStatus(fp, s.shape.name, s.version, s.pinned_source or s.live.source,
                                   s.drift, s.watch_slots, share))
        return out

    def profiles_to_save(self) -> list[Profile]:
        """Profiles of the models whose scores changed since the last call; marks them saved."""
        out = []
        for fp, s in list(self._models.items()):
            if s.dirty:
                out.append(s.live.to_profile(fp, s.watch_slots))
                s.dirty = False
        return out

    def mark_unsaved(self, fingerprint: str) -> None:
        """A save failed: offer the profile again at the next save."""
        state = self._models.get(fingerprint)
        if state is not None:
            state.dirty = True
