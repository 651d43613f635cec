"""Residency: which pair sits in which slot. Pure logic, no torch.

The engine asks `lookup(pair)` for every routed expert; this is the seam later eviction policies
(recency/frequency over a pinned core) plug into. For now residency is static: the first
`num_slots` distinct pairs of a ranking (a profile, or layer order) stay resident.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

Pair = tuple[int, int]  # (layer, expert)


class ResidencyPolicy(Protocol):
    num_slots: int

    def lookup(self, pair: Pair) -> int | None:
        """The slot holding `pair`, or None on a miss."""
        ...

    def plan_fill(self, ranked_pairs: Iterable[Pair]) -> list[tuple[int, Pair]]:
        """(slot, pair) assignments for a pre-fill from a ranking; replaces current residency."""
        ...


class StaticResidency:
    def __init__(self, num_slots: int):
        assert num_slots >= 0
        self.num_slots = num_slots
        self._slot_of: dict[Pair, int] = {}

    def lookup(self, pair: Pair) -> int | None:
        return self._slot_of.get(pair)

    def plan_fill(self, ranked_pairs: Iterable[Pair]) -> list[tuple[int, Pair]]:
        self._slot_of = {}
        for pair in ranked_pairs:
            if len(self._slot_of) == self.num_slots:
                break
            pair = (int(pair[0]), int(pair[1]))
            if pair not in self._slot_of:
                self._slot_of[pair] = len(self._slot_of)
        return [(slot, pair) for pair, slot in self._slot_of.items()]

    @property
    def resident_pairs(self) -> list[Pair]:
        return sorted(self._slot_of, key=self._slot_of.__getitem__)
