"""Expert-cache counters: the one set of types from the cache to the wire.

One *lookup* is one routed (token, layer, expert); hits and misses are counted in tokens.
Misses are split by where they ran: from host memory (the CPU kernels on the host store, the
CUDA kernel reading it in place over the link, or the CPU computing for a device without that
kernel), or copied over the link first; *spilled* is every miss, both kinds: routed expert work
that no cache slot served. Prefetch quality is counted in distinct pairs per (step, layer):
precision = predicted pairs that were routed / predicted pairs; recall = routed pairs that were
predicted / routed pairs (over the layers that had a prediction).

The expert cache counts into CacheCounters; a sequence or request keeps PhaseCounters (decode,
prefill); the engine's lifetime totals, its status, a request's figures and the cache manager's
reports carry the same fields as the strata.v1.CacheCounters message (protos/strata/v1/
counters.proto), converted only by `to_proto` / `from_proto` here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from services.common.pb.strata.v1 import counters_pb2


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
        out = CacheCounters(**{name: getattr(self, name) for name in _COUNTS})
        out.reasons = dict(self.reasons)
        return out

    def add(self, other: CacheCounters) -> None:
        for name in _COUNTS:  # (a few per request a step: no dataclasses.fields() each time)
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for k, v in other.reasons.items():
            self.reasons[k] = self.reasons.get(k, 0) + v

    def since(self, earlier: CacheCounters) -> CacheCounters:
        """self - earlier, field by field."""
        out = CacheCounters(**{name: getattr(self, name) - getattr(earlier, name)
                               for name in _COUNTS})
        out.reasons = {k: v - earlier.reasons.get(k, 0) for k, v in self.reasons.items()
                       if v != earlier.reasons.get(k, 0)}
        return out


_COUNTS = tuple(f.name for f in fields(CacheCounters) if f.name != "reasons")  # the int fields


class DecodeFigures:
    """The figures of a holder of `decode` CacheCounters (a prompt's tokens are routed once,
    its decode tokens are what the cache serves)."""

    decode: CacheCounters

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
    def spill_ratio(self) -> float:
        """Routed experts served by no cache slot (run from host memory or copied first)."""
        return self.decode.spill_ratio


class ByPhase(DecodeFigures):
    """DecodeFigures, and those of the `prefill` CacheCounters too."""

    prefill: CacheCounters

    @property
    def prefill_lookups(self) -> int:
        return self.prefill.lookups

    @property
    def prefill_hits(self) -> int:
        return self.prefill.hits


@dataclass
class PhaseCounters(ByPhase):
    """The counters of one sequence, per phase."""

    decode: CacheCounters = field(default_factory=CacheCounters)
    prefill: CacheCounters = field(default_factory=CacheCounters)

    def add(self, counters: CacheCounters, prefill: bool) -> None:
        (self.prefill if prefill else self.decode).add(counters)


def to_proto(c: CacheCounters) -> counters_pb2.CacheCounters:
    return counters_pb2.CacheCounters(**{f.name: getattr(c, f.name) for f in fields(c)})


def from_proto(pb: counters_pb2.CacheCounters) -> CacheCounters:
    c = CacheCounters(**{f.name: getattr(pb, f.name) for f in fields(CacheCounters)
                         if f.name != "reasons"})
    c.reasons = dict(pb.reasons)
    return c
