"""Residency: which pair sits in which slot. Pure logic, no torch — the engine's ExpertCache,
`strata cache replay` and `strata bench cache` all drive this same code.

    slots = [ pinned core (hottest pairs of the profile, never evicted) | dynamic region ]
                                                                           eviction order:
                                                                           lru | lfu | crf

One `access(layer, entries)` per layer and step: `entries` are the step's *distinct* experts of
that layer with the number of tokens routed to each (all sequences of the batch together), so a
pair is looked up and fetched once per step however many tokens use it. Hits are touched first;
then each miss is offered to the dynamic region, which admits it (evicting a victim) or bypasses
it (the miss is served without taking a slot). Pairs of the batch being served are *protected*:
never chosen as victims, so a slot is not overwritten while this layer still reads it.
`prefetch(layer, experts)` admits predicted pairs of the next layer the same way, without counting
them as uses, and protects them until that layer's `access`.

Eviction orders of the dynamic region (the clock ticks once per pair access):
  lru  least recently used
  lfu  fewest uses while resident; ties -> least recently used
  crf  combined recency and frequency (LRFU, Lee et al. 2001): every pair keeps
       C = sum over its past uses of 2^(-lambda * age); evict the lowest C. lambda -> 0 is LFU,
       lambda = 1 is LRU. History outlives eviction, and a miss is admitted only when its C is
       at least the victim's (a one-off pair does not push out a recurring one).
"""

from __future__ import annotations

import collections
import heapq
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

Pair = tuple[int, int]  # (layer, expert)

POLICIES = ("static", "lru", "lfu", "crf")
# Defaults chosen by replaying held-out traces of the demo model (`strata bench cache`; tuned on
# the swapped prompt sets, two seeds): crf beat lru and lfu at every coverage; lambda 0.005 beat
# 0.002 and 0.01; a pinned core of 0-25% tied and 50% lost ~0.2 points; keeping prefill misses
# out of the dynamic region won ~0.05; next-layer prefetch added 0.5-1.5 points.
DEFAULT_POLICY = "crf"
DEFAULT_PINNED_FRACTION = 0.25
DEFAULT_CRF_LAMBDA = 0.005
DEFAULT_ADMIT_PREFILL = False
DEFAULT_PREFETCH = True


@dataclass(frozen=True)
class PolicySpec:
    """A residency policy and its parameters; `static` pins every slot."""

    name: str = DEFAULT_POLICY
    pinned_fraction: float = DEFAULT_PINNED_FRACTION
    crf_lambda: float = DEFAULT_CRF_LAMBDA  # decay per pair access (crf only)
    admit_prefill: bool = DEFAULT_ADMIT_PREFILL  # prefill misses may take dynamic slots

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"unknown cache policy {self.name!r} (choose from {POLICIES})")
        if not 0.0 <= self.pinned_fraction <= 1.0:
            raise ValueError(f"pinned fraction {self.pinned_fraction} outside [0, 1]")
        if not 0.0 < self.crf_lambda <= 1.0:
            raise ValueError(f"crf lambda {self.crf_lambda} outside (0, 1]")

    def num_pinned(self, num_slots: int) -> int:
        return num_slots if self.name == "static" else round(num_slots * self.pinned_fraction)

    @property
    def label(self) -> str:
        if self.name == "static":
            return "static"
        return f"{self.name} (pinned {self.pinned_fraction:.0%})"


class Outcome(NamedTuple):
    """Where one distinct pair of a step is served from."""

    slot: int | None  # the device slot it runs from; None: bypassed (served from the host store)
    hit: bool  # resident before this step
    fill: bool  # admitted miss: the slot must be filled from the host store before use


class EvictionOrder(Protocol):
    """Ranks the dynamic region's pairs for eviction. `now` is the pair-access clock."""

    def insert(self, pair: Pair, now: int, used: bool) -> None: ...
    def touch(self, pair: Pair, now: int) -> None: ...
    def remove(self, pair: Pair) -> None: ...
    def victim(self, protected: set[Pair]) -> Pair | None: ...
    def admits(self, pair: Pair, victim: Pair, now: int) -> bool:
        """Whether `pair`, about to be used (a miss, or a prediction), may evict `victim`."""
        ...
    def note_miss(self, pair: Pair, now: int) -> None: ...


class LRUOrder:
    def __init__(self) -> None:
        self._order: OrderedDict[Pair, None] = OrderedDict()  # least recent first

    def insert(self, pair: Pair, now: int, used: bool) -> None:
        self._order[pair] = None

    def touch(self, pair: Pair, now: int) -> None:
        self._order.move_to_end(pair)

    def remove(self, pair: Pair) -> None:
        del self._order[pair]

    def victim(self, protected: set[Pair]) -> Pair | None:
        return next((p for p in self._order if p not in protected), None)

    def admits(self, pair: Pair, victim: Pair, now: int) -> bool:
        return True

    def note_miss(self, pair: Pair, now: int) -> None:
        pass


class _ScoredOrder:
    """Evicts the pair with the smallest key (ties: the earlier seq). A min-heap of (key, seq,
    pair) entries, each no larger than its pair's current key: a subclass's touch only ever
    raises a pair's key, so it just records the new one (`_raise`, a hit's whole cost), and
    victim() re-files an entry it finds below its pair's current key; entries of pairs no longer
    resident are dropped when they surface."""

    def __init__(self) -> None:
        self._key: dict[Pair, tuple[float, int]] = {}  # resident pairs only
        self._heap: list[tuple[float, int, Pair]] = []

    def _push(self, pair: Pair, key: tuple[float, int]) -> None:
        self._key[pair] = key
        heapq.heappush(self._heap, (*key, pair))
        if len(self._heap) > 4 * len(self._key) + 64:  # drop stale entries
            self._heap = [(*k, p) for p, k in self._key.items()]
            heapq.heapify(self._heap)

    def _raise(self, pair: Pair, key: tuple[float, int]) -> None:
        self._key[pair] = key  # > the pair's key before (tests/engine/test_policy_residency.py)

    def remove(self, pair: Pair) -> None:
        del self._key[pair]

    def victim(self, protected: set[Pair]) -> Pair | None:
        skipped = []
        found = None
        while self._heap:
            key0, key1, pair = self._heap[0]
            key = self._key.get(pair)
            if key is None:
                heapq.heappop(self._heap)  # evicted since
            elif key != (key0, key1):
                heapq.heapreplace(self._heap, (*key, pair))  # raised since: re-file
            elif pair in protected:
                skipped.append(heapq.heappop(self._heap))
            else:
                found = pair
                break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return found


class LFUOrder(_ScoredOrder):
    def __init__(self) -> None:
        super().__init__()
        self._uses: dict[Pair, int] = {}

    def insert(self, pair: Pair, now: int, used: bool) -> None:
        self._uses[pair] = int(used)
        self._push(pair, (float(used), now))

    def touch(self, pair: Pair, now: int) -> None:
        self._uses[pair] += 1
        self._raise(pair, (float(self._uses[pair]), now))

    def remove(self, pair: Pair) -> None:
        super().remove(pair)
        del self._uses[pair]

    def admits(self, pair: Pair, victim: Pair, now: int) -> bool:
        return True

    def note_miss(self, pair: Pair, now: int) -> None:
        pass


class CRFOrder(_ScoredOrder):
    """Keys are log2(C) + lambda * t_last: the same order as C decayed to any common time."""

    def __init__(self, decay: float):
        super().__init__()
        self.decay = decay
        self._history: dict[Pair, tuple[float, int]] = {}  # pair -> (C at t_last, t_last)

    def _crf(self, pair: Pair, now: int) -> float:
        c, t_last = self._history.get(pair, (0.0, now))
        return c * 2.0 ** (-self.decay * (now - t_last))

    def _key_of(self, pair: Pair, now: int) -> float:
        c, t_last = self._history.get(pair, (0.0, now))
        return (math.log2(c) if c > 0 else -1e18) + self.decay * t_last

    def _use(self, pair: Pair, now: int) -> None:
        self._history[pair] = (1.0 + self._crf(pair, now), now)

    def insert(self, pair: Pair, now: int, used: bool) -> None:
        if used:
            self._use(pair, now)
        self._push(pair, (self._key_of(pair, now), now))

    def touch(self, pair: Pair, now: int) -> None:
        # _use then _key_of, in one lookup (a hit's whole cost; the same arithmetic)
        c, t_last = self._history.get(pair, (0.0, now))
        c = 1.0 + c * 2.0 ** (-self.decay * (now - t_last))
        self._history[pair] = (c, now)
        self._raise(pair, (math.log2(c) + self.decay * now, now))

    def admits(self, pair: Pair, victim: Pair, now: int) -> bool:
        return 1.0 + self._crf(pair, now) >= self._crf(victim, now)  # C of pair once it is used

    def note_miss(self, pair: Pair, now: int) -> None:
        self._use(pair, now)  # a bypassed miss still counts towards its pair's history


def make_order(spec: PolicySpec) -> EvictionOrder:
    if spec.name == "crf":
        return CRFOrder(spec.crf_lambda)
    if spec.name == "lfu":
        return LFUOrder()
    return LRUOrder()  # lru; static never evicts


class Residency:
    """Pinned core + dynamic region over `num_slots` slots (slots 0..P-1 pinned)."""

    def __init__(self, num_slots: int, spec: PolicySpec | None = None):
        assert num_slots >= 0
        self.spec = spec or PolicySpec()
        self.num_slots = num_slots
        self.num_pinned = self.spec.num_pinned(num_slots)
        self.num_dynamic = num_slots - self.num_pinned
        self._hit = [Outcome(slot, True, False) for slot in range(num_slots)]  # a hit's, a slot
        self.clock = 0
        self.evictions = 0
        self._plan: _PlanProgress | None = None  # a plan being applied (begin_plan)
        self._reset()

    def _reset(self) -> None:
        self._slot_of: dict[Pair, int] = {}
        self._pinned: set[Pair] = set()
        self._free = list(range(self.num_slots - 1, self.num_pinned - 1, -1))  # pop() -> lowest
        self._order = make_order(self.spec)
        self._protected: set[Pair] = set()

    @property
    def num_resident(self) -> int:
        return len(self._slot_of)

    @property
    def resident_pairs(self) -> list[Pair]:
        """Resident pairs in slot order."""
        return sorted(self._slot_of, key=self._slot_of.__getitem__)

    def lookup(self, pair: Pair) -> int | None:
        """The slot holding `pair`, or None; no side effects."""
        return self._slot_of.get(pair)

    def plan_fill(self, ranked_pairs: Iterable[Pair]) -> list[tuple[int, Pair]]:
        """(slot, pair) assignments for a pre-fill; replaces current residency. The first
        `num_pinned` distinct pairs form the pinned core, the next ones fill the dynamic region
        (entered coldest first, so the hottest ranks as most recent)."""
        self._reset()
        chosen: list[Pair] = []
        seen: set[Pair] = set()
        for pair in ranked_pairs:
            if len(chosen) == self.num_slots:
                break
            pair = (int(pair[0]), int(pair[1]))
            if pair not in seen:
                seen.add(pair)
                chosen.append(pair)
        for slot, pair in enumerate(chosen[: self.num_pinned]):
            self._slot_of[pair] = slot
            self._pinned.add(pair)
        dynamic = chosen[self.num_pinned :]
        for pair in dynamic:
            self._slot_of[pair] = self._free.pop()
        for pair in reversed(dynamic):
            self._order.insert(pair, self.clock, used=False)
        return [(self._slot_of[pair], pair) for pair in chosen]

    def access(self, layer: int, entries: Sequence[tuple[int, int]],
               prefill: bool | Sequence[bool] = False) -> list[Outcome]:
        """One step of one layer: `entries` = distinct (expert, num_tokens); one Outcome each.
        `prefill` says, for the step or per entry, whether only prefill tokens routed there
        (such misses are admitted only with `admit_prefill`)."""
        flags = [prefill] * len(entries) if isinstance(prefill, bool) else list(prefill)
        pairs = [(layer, expert) for expert, _ in entries]
        self._protected = set(pairs)
        outcomes: list[Outcome | None] = [None] * len(entries)
        misses = []
        slot_of, pinned, touch, hit = self._slot_of.get, self._pinned, self._order.touch, self._hit
        clock = self.clock
        for i, pair in enumerate(pairs):  # (locals: this loop is every lookup's cost)
            slot = slot_of(pair)
            clock += 1
            if slot is None:
                misses.append((i, pair, clock))
                continue
            if pair not in pinned:
                touch(pair, clock)
            outcomes[i] = hit[slot]
        self.clock = clock
        for i, pair, now in misses:
            admit = not flags[i] or self.spec.admit_prefill
            slot = self._admit(pair, now, used=True) if admit else None
            if slot is None:
                if self.num_dynamic:
                    self._order.note_miss(pair, now)
                outcomes[i] = Outcome(None, False, False)
            else:
                outcomes[i] = Outcome(slot, False, True)
        return outcomes  # type: ignore[return-value]

    def hit_every_pair(self, lookups: int) -> None:
        """`lookups` lookups while every pair is resident, all hits: the clock moves on as in
        `access`, the order is not updated. It only ranks eviction victims, and there is none
        to choose until a plan takes a pair out; the ranks are then the ones from before every
        pair was resident (a `plan_fill` ranks afresh)."""
        self.clock += lookups

    def prefetch(self, layer: int, experts: Iterable[int]) -> list[tuple[int, Pair]]:
        """Admit predicted pairs of `layer` ahead of its access; (slot, pair) fills to start.
        Protected (with the batch being served) until the next `access`."""
        fills = []
        for expert in experts:
            pair = (layer, int(expert))
            self._protected.add(pair)
            if pair in self._slot_of:
                continue
            slot = self._admit(pair, self.clock, used=False)
            if slot is not None:
                fills.append((slot, pair))
        return fills

    def _admit(self, pair: Pair, now: int, used: bool) -> int | None:
        if self.num_dynamic == 0:
            return None
        if self._free:
            slot = self._free.pop()
        else:
            victim = self._order.victim(self._protected)
            if victim is None or not self._order.admits(pair, victim, now):
                return None
            slot = self._slot_of.pop(victim)
            self._order.remove(victim)
            self.evictions += 1
        self._slot_of[pair] = slot
        self._order.insert(pair, now, used=used)
        return slot

    # -- a new plan, a few slots at a time -----------------------------------------------------
    def begin_plan(self, ranked_pairs: Iterable[Pair]) -> None:
        """Start moving towards the residency `plan_fill(ranked_pairs)` sets up, without a
        reset: pairs the plan keeps stay in their slots, and each `plan_step` makes a bounded
        number of swaps, so serving goes on in between (lookups and evictions as usual).
        Replaces a plan still in progress; a `plan_fill` cancels it."""
        chosen = _distinct(ranked_pairs, self.num_slots)
        pinned = chosen[: self.num_pinned]
        kept = set(pinned) & self._pinned
        in_pinned_region = {slot: pair for pair, slot in self._slot_of.items()
                            if slot < self.num_pinned}
        wanted = set(chosen)
        self._plan = _PlanProgress(
            slot_of=self._slot_of,
            pinned=collections.deque(p for p in pinned if p not in kept),
            pinned_slots=collections.deque(s for s in range(self.num_pinned)
                                           if in_pinned_region.get(s) not in kept),
            in_pinned_region=in_pinned_region,
            dynamic=chosen[self.num_pinned :],
            # Dynamic pairs the plan does not want, oldest admitted first: the plan's victims.
            victims=collections.deque(p for p in self._slot_of
                                      if p not in self._pinned and p not in wanted))

    def plan_step(self, max_swaps: int) -> tuple[list[tuple[int, Pair]], bool]:
        """Up to `max_swaps` (slot, pair) fills towards the plan (pinned core first, then the
        dynamic region, hottest first); True once the plan is in place."""
        plan = self._plan
        if plan is None or plan.slot_of is not self._slot_of:  # none, or a plan_fill since
            return [], True
        fills: list[tuple[int, Pair]] = []
        while len(fills) < max_swaps and plan.pinned:
            pair, slot = plan.pinned.popleft(), plan.pinned_slots.popleft()
            old = plan.in_pinned_region.get(slot)
            if old is not None:
                del self._slot_of[old]
                self._pinned.discard(old)
            if pair in self._slot_of:  # resident in the dynamic region: it moves to the core
                self._free.append(self._slot_of.pop(pair))
                self._order.remove(pair)
            self._slot_of[pair] = slot
            self._pinned.add(pair)
            plan.in_pinned_region[slot] = pair
            fills.append((slot, pair))
        while len(fills) < max_swaps and plan.next_dynamic < len(plan.dynamic):
            pair = plan.dynamic[plan.next_dynamic]
            if pair not in self._slot_of:
                slot = self._plan_slot(plan)
                if slot is None:  # the dynamic region holds only pairs the plan wants
                    plan.next_dynamic = len(plan.dynamic)
                    break
                self._slot_of[pair] = slot
                self._order.insert(pair, self.clock, used=False)
                fills.append((slot, pair))
            plan.next_dynamic += 1
        done = not plan.pinned and plan.next_dynamic >= len(plan.dynamic)
        if done:
            self._plan = None
        return fills, done

    def _plan_slot(self, plan: _PlanProgress) -> int | None:
        """A dynamic slot for a planned pair: a free one, else one of a pair the plan drops."""
        if self.num_dynamic == 0:
            return None
        if self._free:
            return self._free.pop()
        while plan.victims:
            victim = plan.victims.popleft()
            if victim in self._slot_of and victim not in self._pinned:
                self._order.remove(victim)
                return self._slot_of.pop(victim)
        return None


@dataclass
class _PlanProgress:
    """Where `Residency.begin_plan` ... `plan_step` stands."""

    slot_of: dict[Pair, int]  # the residency map it started from (a plan_fill replaces it)
    pinned: collections.deque[Pair]  # core pairs still to place, hottest first
    pinned_slots: collections.deque[int]  # core slots they go to (empty, or a dropped pair's)
    in_pinned_region: dict[int, Pair]  # core slot -> its pair
    dynamic: list[Pair]  # the plan's dynamic pairs, hottest first
    victims: collections.deque[Pair]
    next_dynamic: int = 0


def _distinct(ranked_pairs: Iterable[Pair], limit: int) -> list[Pair]:
    """The first `limit` distinct pairs of a ranking, as int tuples."""
    chosen: list[Pair] = []
    seen: set[Pair] = set()
    for pair in ranked_pairs:
        if len(chosen) == limit:
            break
        pair = (int(pair[0]), int(pair[1]))
        if pair not in seen:
            seen.add(pair)
            chosen.append(pair)
    return chosen


class StaticResidency(Residency):
    """Every slot pinned from a ranking; nothing is ever evicted."""

    def __init__(self, num_slots: int):
        super().__init__(num_slots, PolicySpec("static"))
