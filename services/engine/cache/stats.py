"""Cache counters, shared by the engine's ExpertCache and the offline replay so both count the
same way. Pure Python.

One *lookup* is one routed (token, layer, expert); hits and misses are counted in tokens.
Misses are split by where they ran: from host memory (the CPU kernels on the host store, the
CUDA kernel reading it in place over the link, or the CPU computing for a device without that
kernel), or copied over the link first.
Prefetch quality is counted in distinct pairs per (step, layer): precision = predicted pairs
that were routed / predicted pairs; recall = routed pairs that were predicted / routed pairs
(over the layers that had a prediction).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields

from services.engine.cache.policy import Outcome


@dataclass
class CacheCounters:
    lookups: int = 0
    hits: int = 0
    misses_host: int = 0  # missed tokens run from host memory
    misses_copied: int = 0  # missed tokens computed on the device after a copy over the link
    fills: int = 0  # slots filled on demand (admitted misses)
    prefetch_fills: int = 0  # slots filled ahead of use by prefetch
    predicted: int = 0  # distinct pairs predicted for the next layer
    predicted_routed: int = 0  # ... of which that layer then routed to
    routed_with_prediction: int = 0  # distinct pairs routed in layers that had a prediction
    reasons: dict[str, int] = field(default_factory=dict)  # placement reason -> missed pairs

    @property
    def spilled(self) -> int:
        return self.lookups - self.hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    @property
    def spill_ratio(self) -> float:
        return self.spilled / self.lookups if self.lookups else 0.0

    @property
    def prefetch_precision(self) -> float:
        return self.predicted_routed / self.predicted if self.predicted else 0.0

    @property
    def prefetch_recall(self) -> float:
        return (self.predicted_routed / self.routed_with_prediction
                if self.routed_with_prediction else 0.0)

    def copy(self) -> CacheCounters:
        out = CacheCounters(**{f.name: getattr(self, f.name) for f in fields(self)})
        out.reasons = dict(self.reasons)
        return out

    def add(self, other: CacheCounters) -> None:
        for f in fields(self):
            if f.name == "reasons":
                for k, v in other.reasons.items():
                    self.reasons[k] = self.reasons.get(k, 0) + v
            else:
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def since(self, earlier: CacheCounters) -> CacheCounters:
        """self - earlier, field by field."""
        out = CacheCounters()
        for f in fields(self):
            if f.name == "reasons":
                out.reasons = {k: v - earlier.reasons.get(k, 0) for k, v in self.reasons.items()
                               if v != earlier.reasons.get(k, 0)}
            else:
                setattr(out, f.name, getattr(self, f.name) - getattr(earlier, f.name))
        return out


@dataclass
class PhaseCounters:
    """The counters of one sequence (or request), per phase; the unprefixed figures are the
    decode's (a prompt's tokens are routed once, its decode tokens are what the cache serves)."""

    decode: CacheCounters = field(default_factory=CacheCounters)
    prefill: CacheCounters = field(default_factory=CacheCounters)

    def add(self, counters: CacheCounters, prefill: bool) -> None:
        (self.prefill if prefill else self.decode).add(counters)

    @property
    def lookups(self) -> int:
        return self.decode.lookups

    @property
    def hits(self) -> int:
        return self.decode.hits

    @property
    def spilled(self) -> int:
        return self.decode.spilled

    @property
    def hit_rate(self) -> float:
        return self.decode.hit_rate

    @property
    def prefill_lookups(self) -> int:
        return self.prefill.lookups

    @property
    def prefill_hits(self) -> int:
        return self.prefill.hits


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
