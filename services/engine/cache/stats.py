"""How the expert cache counts, shared by the engine's ExpertCache and the offline replay so
both count the same way: phases of a mixed step, prefetch predictions scored against the
routing. The counters themselves are services/common/counters.py's. Pure Python.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from services.common.counters import CacheCounters
from services.engine.cache.policy import Outcome


def count_phases(decode: CacheCounters, prefill: CacheCounters,
                 phases: Sequence[tuple[int, int, int]], outcomes: Sequence[Outcome]) -> None:
    """Count one layer's (expert, decode tokens, prefill tokens) entries of a step that may mix
    decode and prefill tokens; a fill is the decode phase's when a decode token wanted it."""
    for (_, d, p), out in zip(phases, outcomes, strict=True):
        decode.lookups += d
        prefill.lookups += p
        if out.hit:
            decode.hits += d
            prefill.hits += p
        elif out.fill:
            (decode if d else prefill).fills += 1


class PredictionTracker:
    """Pairs predicted for a layer, scored against what that layer then routes to."""

    def __init__(self) -> None:
        self._pending: dict[int, set[int]] = {}

    def predict(self, layer: int, experts: Iterable[int]) -> None:
        self._pending[layer] = set(experts)

    def pending(self, layer: int) -> bool:
        """Whether a prediction for `layer` waits to be scored."""
        return layer in self._pending

    def routed(self, c: CacheCounters, layer: int, experts: Iterable[int]) -> None:
        predicted = self._pending.pop(layer, None)
        if predicted is None:
            return
        actual = set(experts)
        c.predicted += len(predicted)
        c.predicted_routed += len(predicted & actual)
        c.routed_with_prediction += len(actual)

    def clear(self) -> None:
        self._pending.clear()
