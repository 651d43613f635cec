"""Residency policies on hand-made traces: eviction order, pinned core, protection, admission,
prefetch. Pure logic, no torch."""

from __future__ import annotations

import pytest

from services.engine.cache.policy import (
    POLICIES,
    Outcome,
    PolicySpec,
    Residency,
    StaticResidency,
)


def run(res: Residency, layer: int, experts: list[int], prefill: bool = False) -> list[Outcome]:
    return res.access(layer, [(e, 1) for e in experts], prefill=prefill)


def dynamic(name: str, slots: int, **kw) -> Residency:
    res = Residency(slots, PolicySpec(name, 0.0, **kw))
    res.plan_fill([])
    return res


def test_spec_validation_and_split():
    assert PolicySpec("static").num_pinned(10) == 10
    assert PolicySpec("lru", 0.25).num_pinned(10) == 2  # round(2.5) -> 2 (banker's)
    assert PolicySpec("crf", 0.5).num_pinned(7) == 4
    for bad in (dict(name="fifo"), dict(pinned_fraction=1.5), dict(crf_lambda=0.0)):
        with pytest.raises(ValueError):
            PolicySpec(**bad)


def test_lru_evicts_least_recently_used():
    res = dynamic("lru", 3)
    for e in (1, 2, 3):
        assert run(res, 0, [e]) == [Outcome(res.lookup((0, e)), False, True)]
    assert run(res, 0, [1])[0].hit  # order now 2, 3, 1
    out = run(res, 0, [4])[0]
    assert out.fill and res.lookup((0, 2)) is None and out.slot is not None
    assert {p for p in res.resident_pairs} == {(0, 1), (0, 3), (0, 4)}
    run(res, 0, [5])
    assert res.lookup((0, 3)) is None and res.evictions == 2


def test_lfu_evicts_least_used_then_least_recent():
    res = dynamic("lfu", 3)
    for e in (1, 1, 1, 2, 2, 3):  # uses: 1 -> 3, 2 -> 2, 3 -> 1
        run(res, 0, [e])
    run(res, 0, [4])  # evicts 3 (fewest uses)
    assert res.lookup((0, 3)) is None
    run(res, 0, [5])  # 4 and 2... 4 has 1 use, the least: evicted
    assert res.lookup((0, 4)) is None and res.lookup((0, 2)) is not None


def test_crf_balances_frequency_and_recency():
    # Small lambda: frequency wins. Pair 1 used 5 times long ago outranks pair 2 used once now.
    res = dynamic("crf", 2, crf_lambda=0.01)
    for e in (1, 1, 1, 1, 1, 2):
        run(res, 0, [e])
    run(res, 0, [3])  # a one-off: C(3)=1 after use ~= C(2); evicts 2, not the frequent 1
    assert res.lookup((0, 1)) is not None and res.lookup((0, 2)) is None
    # lambda = 1 is LRU: the five old uses have decayed away.
    lru_like = dynamic("crf", 2, crf_lambda=1.0)
    for e in (1, 1, 1, 1, 1, 2, 3):
        run(lru_like, 0, [e])
    assert lru_like.lookup((0, 1)) is None and lru_like.lookup((0, 2)) is not None


def test_crf_bypasses_a_one_off_miss_that_ranks_below_every_resident():
    res = dynamic("crf", 2, crf_lambda=0.001)
    for e in (1, 2) * 4:
        run(res, 0, [e])
    out = run(res, 0, [9])[0]
    assert out == Outcome(None, False, False)  # served from the host, no slot taken
    assert res.lookup((0, 1)) is not None and res.lookup((0, 2)) is not None
    for _ in range(8):  # ...until it has been used often enough
        out = run(res, 0, [9])[0]
    assert out.hit or out.fill


def test_pinned_core_is_never_evicted():
    res = Residency(4, PolicySpec("lru", 0.5))
    plan = res.plan_fill([(0, 0), (0, 1), (0, 2), (0, 3), (0, 4)])
    assert plan == [(0, (0, 0)), (1, (0, 1)), (2, (0, 2)), (3, (0, 3))]
    for e in range(5, 12):
        run(res, 0, [e])
    assert res.lookup((0, 0)) == 0 and res.lookup((0, 1)) == 1
    assert (0, 2) not in res.resident_pairs and len(res.resident_pairs) == 4


def test_batch_is_protected_and_each_pair_looked_up_once():
    res = dynamic("lru", 2)
    outs = run(res, 0, [1, 2, 3])  # 3 distinct misses, 2 slots: the third cannot evict
    assert [o.fill for o in outs] == [True, True, False] and outs[2].slot is None
    outs = res.access(1, [(4, 7), (5, 1)])  # token counts do not multiply lookups
    assert [o.fill for o in outs] == [True, True]
    assert res.lookup((0, 1)) is None and res.lookup((0, 2)) is None


def test_prefetch_admits_predictions_and_protects_them_until_used():
    res = dynamic("lru", 3)
    run(res, 0, [1, 2])
    fills = res.prefetch(1, [5, 1])
    # one free slot; the second prediction may not evict layer 0's batch (still being served)
    assert [pair for _, pair in fills] == [(1, 5)]
    assert res.lookup((0, 1)) is not None and res.lookup((0, 2)) is not None
    outs = run(res, 1, [5, 6])  # the prediction is now a hit; protected from this batch's miss
    assert outs[0].hit and outs[1].fill and res.lookup((1, 5)) is not None


def test_prefill_misses_bypass_when_not_admitted():
    res = Residency(2, PolicySpec("lru", 0.0, admit_prefill=False))
    res.plan_fill([])
    assert run(res, 0, [1], prefill=True) == [Outcome(None, False, False)]
    assert run(res, 0, [1])[0].fill


def test_static_never_changes():
    res = StaticResidency(2)
    res.plan_fill([(0, 3), (1, 4)])
    assert run(res, 0, [1, 3]) == [Outcome(None, False, False), Outcome(0, True, False)]
    assert res.prefetch(0, [7]) == [] and res.resident_pairs == [(0, 3), (1, 4)]


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("pinned", [0.0, 0.5, 1.0])
def test_invariants_on_a_random_trace(name, pinned):
    import random

    rng = random.Random(0)
    res = Residency(10, PolicySpec(name, pinned))
    res.plan_fill([(layer, e) for layer in range(3) for e in range(8)])
    for step in range(300):
        for layer in range(3):
            batch = sorted(rng.sample(range(8), 2))
            outs = run(res, layer, batch, prefill=step % 50 == 0)
            for e, out in zip(batch, outs, strict=True):
                assert out.hit == (out.slot is not None and not out.fill)
                if out.slot is not None:
                    assert res.lookup((layer, e)) == out.slot
            res.prefetch((layer + 1) % 3, rng.sample(range(8), 2))
            slots = list(res._slot_of.values())
            assert len(slots) == len(set(slots)) <= 10 and all(0 <= s < 10 for s in slots)


@pytest.mark.parametrize("name", ["lfu", "crf"])
def test_scored_victim_is_the_smallest_current_key_though_hits_only_record_theirs(name):
    """A hit only records its pair's raised key (no heap entry); victim() must still return the
    pair with the smallest current (key, seq) outside the protected set, as a scan would."""
    import random

    rng = random.Random(1)
    res = Residency(12, PolicySpec(name, 0.0))
    res.plan_fill([])
    order = res._order
    raise_key = order._raise

    def checked_raise(pair, key):
        assert key > order._key[pair]  # what the lazy heap relies on
        raise_key(pair, key)

    order._raise = checked_raise
    for _ in range(400):
        layer = rng.randrange(3)
        protected = {(layer, e) for e in rng.sample(range(10), 3)}
        scan = min(((*k, p) for p, k in order._key.items() if p not in protected),
                   default=None)
        assert order.victim(protected) == (None if scan is None else scan[2])
        run(res, layer, sorted(rng.sample(range(10), rng.randint(1, 4))))
