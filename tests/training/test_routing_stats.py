"""Routing statistics (services.training.routing): the pure functions on hand-made routing
arrays [T, L, K] with known answers, and `strata model routing --json` on the tiny checkpoint."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from services.training.routing import (
    compare,
    consecutive_reuse,
    distance_summary,
    hottest,
    jaccard,
    main,
    pair_counts,
    reuse_distances,
    route_windows,
    spearman,
    split_stats,
    spread_windows,
    static_hit_rate,
)


def same_every_token(T: int = 10, L: int = 2, K: int = 2) -> np.ndarray:
    """Every token routes to experts 0..K-1 at every layer: [T, L, K]."""
    return np.broadcast_to(np.arange(K), (T, L, K)).copy()


def round_robin(T: int, E: int, K: int = 1) -> np.ndarray:
    """Token t routes to experts (t*K .. t*K+K-1) mod E at one layer: [T, 1, K]."""
    return ((np.arange(T)[:, None] * K + np.arange(K)) % E)[:, None, :]


def test_identical_routing_reuses_everything():
    r = same_every_token()
    np.testing.assert_allclose(consecutive_reuse([r]), [1.0, 1.0])
    d = reuse_distances([r], num_experts=4)
    assert d.size == r.size
    assert np.isinf(d).sum() == 4  # first use of each of the 2 x 2 pairs
    assert (d[np.isfinite(d)] == 1).all()
    s = distance_summary(d)
    assert s["p50"] == 1 and s["p90"] == 1
    assert s["within_1"] == s["within_16"] == pytest.approx(36 / 40)
    assert s["first_use"] == pytest.approx(4 / 40)


def test_round_robin_distance_is_the_cycle_length():
    r = round_robin(T=40, E=8)  # each expert comes back every 8 tokens
    assert consecutive_reuse([r])[0] == 0.0
    d = reuse_distances([r], num_experts=8)
    assert (d[np.isfinite(d)] == 8).all() and np.isinf(d).sum() == 8
    s = distance_summary(d)
    assert s["within_1"] == s["within_4"] == 0.0
    assert s["within_16"] == pytest.approx(32 / 40)
    assert s["p50"] == 8
    # K=2 over E=4: tokens alternate {0,1}, {2,3}: no overlap, distance 2
    r2 = round_robin(T=6, E=4, K=2)
    assert consecutive_reuse([r2])[0] == 0.0
    d2 = reuse_distances([r2], 4)
    assert set(d2[np.isfinite(d2)].tolist()) == {2.0} and np.isinf(d2).sum() == 4


def test_partial_overlap_and_window_boundaries():
    # tokens: {0,1} {1,2} {2,3} -> each token after the first shares 1 of 2 experts
    r = np.array([[[0, 1]], [[1, 2]], [[2, 3]]])
    assert consecutive_reuse([r])[0] == pytest.approx(0.5)
    # two windows: the first token of each window has no predecessor, and distances restart
    assert consecutive_reuse([r, r])[0] == pytest.approx(0.5)
    d = reuse_distances([r, r], num_experts=4)
    assert np.isinf(d).sum() == 8 and (d[np.isfinite(d)] == 1).all()
    # p90 lands on first uses -> None
    assert distance_summary(d)["p90"] is None


def test_pair_counts_and_top_shares():
    r = same_every_token(T=10, L=2, K=2)
    counts = pair_counts([r], num_experts=4)
    np.testing.assert_array_equal(counts, [[10, 10, 0, 0], [10, 10, 0, 0]])
    s = split_stats([r], num_experts=4, layer_ids=[0, 1])
    # 8 pairs: hottest 10% = 1 pair (10 of 40), 25% = 2 pairs, 50% = all 4 used pairs
    assert s["pair_top_share"] == {"10%": 0.25, "25%": 0.5, "50%": 1.0}
    assert s["tokens"] == 10 and s["routings"] == 40 and s["windows"] == 1
    layer = s["layers"][1]
    assert layer["layer"] == 1 and layer["consecutive_reuse"] == 1.0
    assert layer["entropy"] == pytest.approx(math.log(2))  # two experts, even load
    assert layer["entropy_ratio"] == pytest.approx(0.5)  # log 2 / log 4


def test_uniform_load_has_entropy_log_e():
    E = 8
    s = split_stats([round_robin(T=32, E=E, K=2)], num_experts=E, layer_ids=[5])
    [layer] = s["layers"]
    assert layer["layer"] == 5
    assert layer["entropy"] == pytest.approx(math.log(E))
    assert layer["entropy_ratio"] == pytest.approx(1.0)
    assert s["pair_top_share"]["50%"] == pytest.approx(0.5)


def test_hottest_jaccard_spearman_static_hits():
    a = np.array([[5, 4, 3, 2], [1, 0, 0, 0]])  # 8 pairs
    assert sorted(hottest(a, 0.25).tolist()) == [0, 1]
    assert hottest(np.zeros((2, 4)), 0.25).tolist() == [0, 1]  # ties: pair order
    assert jaccard(np.array([0, 1]), np.array([1, 2])) == pytest.approx(1 / 3)
    assert spearman(a, a) == pytest.approx(1.0)
    assert spearman(a, -a) == pytest.approx(-1.0)
    assert spearman(a, np.ones_like(a)) is None
    b = np.array([[0, 1, 0, 0], [0, 0, 0, 9]])  # held-out: pair 7 is the hot one
    assert static_hit_rate(a, b, 0.25) == pytest.approx(0.1)  # a's top 2 = pairs 0, 1
    assert static_hit_rate(b, b, 0.25) == pytest.approx(1.0)
    c = compare(a, a)
    assert c["hot25_jaccard"] == 1.0 and c["spearman"] == pytest.approx(1.0)
    for v in c["static_hit_rate"].values():
        assert v["train_profile"] == v["oracle"]
    assert set(c["static_hit_rate"]) == {"10%", "25%", "50%"}


def test_spread_windows():
    stream = np.arange(1000)
    w = spread_windows(stream, num_tokens=300, window=100)
    assert len(w) == 3 and all(len(x) == 100 for x in w)
    assert w[0][0] == 0 and w[-1][-1] == 999  # first and last at the stream's ends
    assert w[1][0] == 450
    [short] = spread_windows(np.arange(50), num_tokens=300, window=100)
    assert len(short) == 50


def test_command_on_tiny_checkpoint(tiny_run, capsys):
    model_dir, summary = tiny_run
    recipe = summary["recipe"]  # 2 layers x 4 experts, top-2, context 64
    rc = main(
        ["--model", str(model_dir), "--tokens", "256", "--corpus-max-bytes", "60000", "--json"]
    )
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    E, K, L = recipe["experts"], recipe["top_k"], recipe["layers"]
    assert (r["moe_layers"], r["num_experts"], r["experts_per_token"]) == (L, E, K)
    assert r["window_tokens"] == recipe["context"]
    assert r["uniform_reuse"] == pytest.approx(K / E)
    for split in ("train", "heldout"):
        s = r[split]
        assert s["tokens"] == 256 and s["windows"] == 256 // recipe["context"]
        assert s["routings"] == s["tokens"] * L * K
        shares = [s["pair_top_share"][k] for k in ("10%", "25%", "50%")]
        assert 0 < shares[0] <= shares[1] <= shares[2] <= 1
        assert 0 <= s["consecutive_reuse"] <= 1
        assert [x["layer"] for x in s["layers"]] == list(range(L))
        for x in s["layers"]:
            assert 0 <= x["entropy"] <= math.log(E) + 1e-9
            assert 0 <= x["entropy_ratio"] <= 1 + 1e-9
            assert 0 <= x["consecutive_reuse"] <= 1
        d = s["reuse_distance"]
        assert 0 <= d["within_1"] <= d["within_4"] <= d["within_16"] <= 1
        assert d["p50"] is None or d["p50"] >= 1
        # a token's K experts are distinct, so "within 1" is exactly consecutive reuse (less the
        # first token of each window, which has no predecessor)
        first = s["windows"] / s["tokens"]
        assert d["within_1"] == pytest.approx(s["consecutive_reuse"] * (1 - first))
    ov = r["overlap"]
    assert 0 <= ov["hot25_jaccard"] <= 1
    assert ov["spearman"] is None or -1 <= ov["spearman"] <= 1
    for v in ov["static_hit_rate"].values():
        assert 0 <= v["train_profile"] <= v["oracle"] <= 1
    assert set(r["heldout_halves"]) == set(ov)  # 4 windows: even vs odd


def test_command_without_a_checkpoint(tmp_path, capsys):
    assert main(["--model", str(tmp_path)]) == 1
    assert "no checkpoint" in capsys.readouterr().err


def test_tap_sees_what_the_engine_routes(tiny_run, tmp_path):
    """Routing recorded by the tap over a prefill step = the expert cache's own counts, and per
    token = the routing trace of the same tokens decoded one at a time."""
    from services.engine.cache.trace import DECODE, Trace
    from services.engine.driver import SequenceDriver
    from services.engine.runner import ModelRunner

    model_dir, _ = tiny_run
    ids = np.arange(3, 3 + 24, dtype=np.int64)
    runner = ModelRunner(
        model_dir,
        device="cpu",
        cache_slots=0,
        reserved_bytes=0,
        record_routing=tmp_path / "trace.bin",
    )
    drive = SequenceDriver(runner)
    runner.take_routing_counts()
    [routes] = list(route_windows(runner, [ids]))  # [T, L, K]
    assert routes.shape == (24, runner.config.num_layers, runner.config.experts_per_token)
    np.testing.assert_array_equal(
        pair_counts([routes], runner.config.num_experts), runner.take_routing_counts()
    )
    seq = drive.start(ids[:1].tolist())
    drive.prefill(seq)
    for t in ids[1:].tolist():
        drive.decode(seq, t)
    drive.release(seq)
    runner.close()
    decoded = [r for r in Trace.read(tmp_path / "trace.bin").records if r.kind == DECODE]
    assert len(decoded) == 23 * runner.config.num_layers
    for i, rec in enumerate(decoded):
        t, layer = 1 + i // runner.config.num_layers, i % runner.config.num_layers
        assert rec.layer == layer
        assert sorted(rec.entries["expert"].tolist()) == sorted(routes[t, layer].tolist())
