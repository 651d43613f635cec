import logging

import numpy as np

from services.cachemgr.planner import (
    SOURCE_COUNTS,
    SOURCE_LAYER_ORDER,
    SOURCE_PROFILE,
    ModelShape,
    Planner,
)
from services.common.profile import Profile

MiB = 2**20
SHAPE = ModelShape("feedc0de", num_layers=4, num_experts=8, slot_bytes=1 * MiB)  # 32 pairs


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def planner(profiles=None, **kwargs) -> Planner:
    kwargs = {"replan_settle_s": 0.0, "half_life_s": 600.0, "clock": Clock()} | kwargs
    return Planner(profiles, **kwargs)


def counts_with(hot: dict[tuple[int, int], int]) -> np.ndarray:
    counts = np.zeros((SHAPE.num_layers, SHAPE.num_experts), dtype=np.int64)  # [L, E]
    for (layer, expert), count in hot.items():
        counts[layer, expert] = count
    return counts


def test_slots_follow_size_cache_and_cap_at_total_pairs():
    p = planner()
    plan = p.plan(SHAPE, None, device_memory_bytes=12 * MiB + 100, reserved_bytes=2 * MiB)
    assert plan.slots == 10 and plan.total_pairs == 32 and len(plan.pairs) == 10
    assert plan.coverage == 10 / 32 and plan.reason == "first plan"
    assert p.plan(SHAPE, None, 1 * MiB, 2 * MiB).slots == 0
    assert p.plan(SHAPE, None, 1000 * MiB, 0).slots == 32


def test_layer_order_without_counts_or_profile():
    plan = planner().plan(SHAPE, None, 5 * MiB, 0)
    assert plan.source == SOURCE_LAYER_ORDER
    assert plan.pairs == ((0, 0), (0, 1), (0, 2), (0, 3), (0, 4))


def test_routing_counts_rank_pairs_ties_in_layer_order():
    counts = counts_with({(3, 7): 9, (1, 2): 4, (0, 5): 4, (2, 2): 1})
    plan = planner().plan(SHAPE, counts, 5 * MiB, 0)
    assert plan.source == SOURCE_COUNTS
    assert plan.pairs == ((3, 7), (0, 5), (1, 2), (2, 2), (0, 0))


def test_profile_ranks_until_counts_arrive_and_then_breaks_their_ties():
    profile = Profile.from_counts(counts_with({(2, 3): 100, (1, 1): 50, (0, 4): 10}),
                                  SHAPE.fingerprint)
    p = planner(profile)
    plan = p.plan(SHAPE, np.zeros((4, 8), dtype=np.int64), 3 * MiB, 0)
    assert plan.source == SOURCE_PROFILE
    assert plan.pairs == ((2, 3), (1, 1), (0, 4))
    # Counts add to the profile's (decayed) counts; equal scores keep the profile's order.
    p.clock.now_s += 1
    p.refresh(SHAPE, counts_with({(3, 0): 200, (0, 6): 40}))
    plan = p.plan(SHAPE, counts_with({(3, 0): 200, (0, 6): 40}), 3 * MiB, 0)
    assert plan.source == SOURCE_COUNTS and plan.version == 2
    assert plan.pairs == ((3, 0), (2, 3), (1, 1))


def test_profile_for_another_model_is_logged_and_ignored(caplog):
    profile = Profile.from_counts(np.ones((2, 2), dtype=np.int64), "othermodel")
    p = planner(profile)
    with caplog.at_level(logging.WARNING, logger="strata.cachemgr"):
        plan = p.plan(SHAPE, None, 2 * MiB, 0)
        p.plan(SHAPE, None, 2 * MiB, 0)
    assert plan.source == SOURCE_LAYER_ORDER
    warnings = [r.getMessage() for r in caplog.records if "no expert profile" in r.message]
    assert len(warnings) == 1 and "othermodel" in warnings[0]
    # Same fingerprint, other shape: rejected with the reason.
    wrong = Profile.from_counts(np.ones((2, 2), dtype=np.int64), SHAPE.fingerprint)
    with caplog.at_level(logging.WARNING, logger="strata.cachemgr"):
        assert planner(wrong).plan(SHAPE, None, 2 * MiB, 0).source == SOURCE_LAYER_ORDER
    assert any("another model" in r.getMessage() for r in caplog.records)


def test_versions_follow_drift_not_reordering():
    p = planner(replan_drift=0.05)
    assert p.version(SHAPE.fingerprint) == 0
    v1 = p.plan(SHAPE, None, 2 * MiB, 0).version  # 2 slots: (0,0), (0,1)
    assert v1 == 1
    assert p.plan(SHAPE, None, 2 * MiB, 0).version == v1
    # Counts arrive: layer order misses all of them -> a new version.
    v2 = p.refresh(SHAPE, counts_with({(1, 1): 5, (2, 2): 3}))
    assert v2 == v1 + 1
    # Reordering inside the pinned top-2 misses nothing: no new version.
    assert p.refresh(SHAPE, counts_with({(1, 1): 5, (2, 2): 9})) == v2
    assert p.plan(SHAPE, None, 2 * MiB, 0).pairs == ((1, 1), (2, 2))  # the pinned order
    # A pair the pinned set misses, worth 3/22 = 14% of the work (>= 5%): a drift event, and
    # a new version once its best set has settled (replan_settle_s=0: at the next look).
    assert p.refresh(SHAPE, counts_with({(1, 1): 5, (2, 2): 9, (3, 3): 8})) == v2
    p.clock.now_s += 1
    v3 = p.refresh(SHAPE, counts_with({(1, 1): 5, (2, 2): 9, (3, 3): 8}))
    assert v3 == v2 + 1
    assert p.plan(SHAPE, None, 2 * MiB, 0).pairs == ((2, 2), (3, 3))
    # A bigger engine widens the watched set without a version of its own...
    plan = p.plan(SHAPE, None, 4 * MiB, 0)
    assert plan.version == v3 and plan.pairs[:3] == ((2, 2), (3, 3), (1, 1))
    # ...and from then on the 4th pair matters: (0,6) with 1 of 24 (4%) is below 5%...
    assert p.refresh(SHAPE, counts_with({(1, 1): 5, (2, 2): 9, (3, 3): 8, (0, 6): 1})) == v3
    # ...with 3 of 26 (11.5%) it is not.
    assert p.refresh(SHAPE, counts_with({(1, 1): 5, (2, 2): 9, (3, 3): 8, (0, 6): 3})) == v3
    p.clock.now_s += 1
    assert p.refresh(SHAPE, counts_with({(1, 1): 5, (2, 2): 9, (3, 3): 8, (0, 6): 3})) == v3 + 1
    assert p.versions() == {SHAPE.fingerprint: v3 + 1}


def test_one_version_per_shift_of_the_hot_set():
    """Steady work on set A, then a lasting shift to set B: exactly one new version, however
    long B lasts; noise below the threshold issues none; decay alone issues none."""
    p = planner(replan_drift=0.02, replan_settle_s=10.0, half_life_s=60.0)
    rng = np.random.default_rng(0)
    slots = 8
    p.plan(SHAPE, None, slots * MiB, 0)
    hot_a = [(layer, expert) for layer in range(4) for expert in (0, 1)]
    hot_b = [(layer, expert) for layer in range(4) for expert in (4, 5)]
    totals = np.zeros((4, 8), dtype=np.int64)
    versions = []

    def step(hot):
        p.clock.now_s += 2.0
        for pair in hot:
            totals[pair] += 300 + rng.integers(0, 20)
        totals[rng.integers(0, 4), rng.integers(0, 8)] += 2  # noise anywhere
        versions.append(p.refresh(SHAPE, totals))

    for _ in range(60):
        step(hot_a)
    assert set(versions) == {2}  # layer order -> counts, at the first counts
    assert set(p.plan(SHAPE, None, slots * MiB, 0).pairs) == set(hot_a)
    for _ in range(200):
        step(hot_b)
    assert sorted(set(versions)) == [2, 3] and versions[-1] == 3
    assert set(p.plan(SHAPE, None, slots * MiB, 0).pairs) == set(hot_b)
    p.clock.now_s += 3600  # idle for an hour: decay alone changes nothing
    assert p.refresh(SHAPE, totals) == 3
    status = p.status()[0]
    assert status.version == 3 and status.drift < 0.02 and status.served_share > 0.95


def test_a_drift_event_waits_for_its_best_set_to_settle_or_closes():
    p = planner(replan_drift=0.1, replan_settle_s=10.0)
    p.plan(SHAPE, None, 1 * MiB, 0)
    assert p.refresh(SHAPE, counts_with({(1, 1): 10})) == 2  # from layer order: at once
    p.refresh(SHAPE, counts_with({(1, 1): 10, (2, 2): 50}))  # the event opens
    p.clock.now_s += 5
    assert p.refresh(SHAPE, counts_with({(1, 1): 10, (2, 2): 50})) == 2  # 5 s < 10 s
    p.clock.now_s += 3
    p.refresh(SHAPE, counts_with({(1, 1): 10, (2, 2): 50, (3, 3): 200}))  # it moves: restart
    p.clock.now_s += 5
    assert p.refresh(SHAPE, counts_with({(1, 1): 10, (2, 2): 50, (3, 3): 200})) == 2
    p.clock.now_s += 5
    assert p.refresh(SHAPE, counts_with({(1, 1): 10, (2, 2): 50, (3, 3): 200})) == 3
    assert p.plan(SHAPE, None, 1 * MiB, 0).pairs == ((3, 3),)
    # An event whose drift falls back below half the threshold closes without a version.
    p.refresh(SHAPE, counts_with({(1, 1): 10, (2, 2): 260, (3, 3): 200}))  # 60/470: opens
    assert p._models[SHAPE.fingerprint].candidate is not None
    p.clock.now_s += 1
    p.refresh(SHAPE, counts_with({(1, 1): 10, (2, 2): 260, (3, 3): 2000}))  # 0: closes
    assert p._models[SHAPE.fingerprint].candidate is None
    p.clock.now_s += 60
    assert p.refresh(SHAPE, counts_with({(1, 1): 10, (2, 2): 260, (3, 3): 2000})) == 3


def test_models_are_versioned_separately():
    p = planner()
    other = ModelShape("0ther", 2, 2, MiB)
    p.plan(SHAPE, None, 2 * MiB, 0)
    p.refresh(SHAPE, counts_with({(3, 3): 1}))
    assert p.plan(other, None, 2 * MiB, 0).version == 1
    assert p.version(SHAPE.fingerprint) == 2


def test_profiles_to_save_only_changed_models():
    p = planner()
    assert p.profiles_to_save() == []
    p.refresh(SHAPE, counts_with({(2, 1): 7, (0, 3): 2}))
    (profile,) = p.profiles_to_save()
    assert profile.fingerprint == SHAPE.fingerprint and profile.top_pairs(2) == [(2, 1), (0, 3)]
    assert len(profile.ranked) == SHAPE.total_pairs
    assert p.profiles_to_save() == []


def test_shape_problems():
    assert ModelShape("", 0, 8, 0).problems() == [
        "model.fingerprint is empty",
        "model shape 0x8 (layers x experts) must be positive",
        "model.slot_bytes=0 must be positive"]
    assert not SHAPE.problems()
