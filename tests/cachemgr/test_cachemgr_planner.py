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


def counts_with(hot: dict[tuple[int, int], int]) -> np.ndarray:
    counts = np.zeros((SHAPE.num_layers, SHAPE.num_experts), dtype=np.int64)  # [L, E]
    for (layer, expert), count in hot.items():
        counts[layer, expert] = count
    return counts


def test_slots_follow_size_cache_and_cap_at_total_pairs():
    planner = Planner()
    plan = planner.plan(SHAPE, None, device_memory_bytes=12 * MiB + 100, reserved_bytes=2 * MiB)
    assert plan.slots == 10 and plan.total_pairs == 32 and len(plan.pairs) == 10
    assert plan.coverage == 10 / 32
    assert planner.plan(SHAPE, None, 1 * MiB, 2 * MiB).slots == 0
    assert planner.plan(SHAPE, None, 1000 * MiB, 0).slots == 32


def test_layer_order_without_counts_or_profile():
    plan = Planner().plan(SHAPE, None, 5 * MiB, 0)
    assert plan.source == SOURCE_LAYER_ORDER
    assert plan.pairs == ((0, 0), (0, 1), (0, 2), (0, 3), (0, 4))


def test_routing_counts_rank_pairs_ties_in_layer_order():
    counts = counts_with({(3, 7): 9, (1, 2): 4, (0, 5): 4, (2, 2): 1})
    plan = Planner().plan(SHAPE, counts, 5 * MiB, 0)
    assert plan.source == SOURCE_COUNTS
    assert plan.pairs == ((3, 7), (0, 5), (1, 2), (2, 2), (0, 0))


def test_profile_ranks_until_counts_arrive_and_then_breaks_their_ties():
    profile_counts = counts_with({(2, 3): 100, (1, 1): 50, (0, 4): 10})
    profile = Profile.from_counts(profile_counts, SHAPE.fingerprint)
    planner = Planner(profile)
    plan = planner.plan(SHAPE, np.zeros((4, 8), dtype=np.int64), 3 * MiB, 0)
    assert plan.source == SOURCE_PROFILE
    assert plan.pairs == ((2, 3), (1, 1), (0, 4))
    # Sparse counts lead; pairs without counts keep the profile's order.
    plan = planner.plan(SHAPE, counts_with({(3, 0): 1}), 3 * MiB, 0)
    assert plan.source == SOURCE_COUNTS
    assert plan.pairs == ((3, 0), (2, 3), (1, 1))


def test_profile_for_another_model_is_logged_and_ignored(caplog):
    profile = Profile.from_counts(np.ones((2, 2), dtype=np.int64), "othermodel")
    planner = Planner(profile)
    with caplog.at_level(logging.WARNING, logger="strata.cachemgr"):
        plan = planner.plan(SHAPE, None, 2 * MiB, 0)
        planner.plan(SHAPE, None, 2 * MiB, 0)
    assert plan.source == SOURCE_LAYER_ORDER
    warnings = [r.getMessage() for r in caplog.records if "ignoring the expert profile" in r.message]
    assert len(warnings) == 1 and "another model" in warnings[0]


def test_version_bumps_only_when_the_resident_set_changes():
    planner = Planner()
    assert planner.version(SHAPE.fingerprint) == 0
    v1 = planner.plan(SHAPE, None, 2 * MiB, 0).version  # 2 slots: (0,0), (0,1)
    assert v1 == 1
    # Same set, same source: no bump.
    assert planner.plan(SHAPE, None, 2 * MiB, 0).version == v1
    # Counts arrive: source changes -> bump.
    hot = counts_with({(1, 1): 5, (2, 2): 3})
    v2 = planner.refresh(SHAPE, hot)
    assert v2 == v1 + 1
    # Reordering inside the watched top-2 changes nothing resident: no bump.
    assert planner.refresh(SHAPE, counts_with({(1, 1): 5, (2, 2): 9})) == v2
    # A new pair enters the top 2: bump.
    v3 = planner.refresh(SHAPE, counts_with({(1, 1): 5, (2, 2): 9, (3, 3): 7}))
    assert v3 == v2 + 1
    # A bigger engine widens the watched set without a bump of its own.
    plan = planner.plan(SHAPE, counts_with({(1, 1): 5, (2, 2): 9, (3, 3): 7}), 4 * MiB, 0)
    assert plan.version == v3 and plan.pairs[:3] == ((2, 2), (3, 3), (1, 1))
    # Now the 4th pair matters.
    assert planner.refresh(SHAPE, counts_with({(1, 1): 5, (2, 2): 9, (3, 3): 7, (0, 6): 1})) == v3 + 1
    assert planner.versions() == {SHAPE.fingerprint: v3 + 1}


def test_models_are_versioned_separately():
    planner = Planner()
    other = ModelShape("0ther", 2, 2, MiB)
    planner.plan(SHAPE, None, 2 * MiB, 0)
    planner.refresh(SHAPE, counts_with({(3, 3): 1}))
    assert planner.plan(other, None, 2 * MiB, 0).version == 1
    assert planner.version(SHAPE.fingerprint) == 2


def test_shape_problems():
    assert ModelShape("", 0, 8, 0).problems() == [
        "model.fingerprint is empty",
        "model shape 0x8 (layers x experts) must be positive",
        "model.slot_bytes=0 must be positive"]
    assert not SHAPE.problems()
