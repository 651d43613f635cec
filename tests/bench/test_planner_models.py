"""Planner hit-rate and cost models: trace replay, decode-only profile counts, the fit's fallback."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from services.bench import planner
from services.bench.fit import fit_cost_model, fit_results
from services.bench.plan_cli import plan_main
from services.bench.planner import MIB, Hardware
from services.bench.stats import fit_median_line
from services.cachemgr.live import LiveProfile
from services.common.profile import Profile
from services.engine.cache.policy import PolicySpec
from services.engine.cache.trace import DECODE, PREFILL, Trace, TraceWriter

FP = "f" * 16


def write_trace(path, steps, prefill_steps=(), policy="static", prefetch=False):
    """One layer of 4 experts; `steps` are decode steps, each a list of routed experts (one
    token each); `prefill_steps` come first."""
    meta = {"fingerprint": FP, "num_layers": 1, "num_experts": 4, "slots": 0, "policy": policy,
            "pinned_fraction": 0.0, "prefetch": prefetch}
    writer = TraceWriter(path, meta)
    for experts in prefill_steps:
        writer.layer_record(PREFILL, 0, experts, [1] * len(experts))
    for experts in steps:
        writer.layer_record(DECODE, 0, experts, [1] * len(experts))
    writer.close()
    return Trace.read(path)


def test_replayed_hit_rate_has_the_known_answer_of_a_static_cache(tmp_path):
    # Every decode step routes experts 0 and 2: a static cache pre-filled 0, 1, 2, 3 hits
    # half of them with 1 or 2 slots (expert 0 only) and all with 3 or more.
    trace = write_trace(tmp_path / "t.trace", [[0, 2]] * 10)
    model = planner.trace_hit_rate(trace, fill=[(0, 0), (0, 1), (0, 2), (0, 3)], label="t")
    assert [model.hit_rate(s) for s in range(5)] == [0.0, 0.5, 0.5, 1.0, 1.0]
    assert model.source == "replayed" and model.basis(2) == "replayed"
    assert model.detail == "trace t replayed through policy static"
    hw = Hardware(3 * MIB, 4, reserved_bytes=700 * MIB)
    row = planner.plan_row(hw, 700 * MIB + 3 * 3 * MIB, model, None)
    assert (row["slots"], row["hit_rate"]) == (3, 1.0)
    assert row["basis"]["hit_rate"] == "replayed" and row["basis"]["hit_rate_source"] == "replayed"


def test_replay_follows_the_dynamic_policy_where_the_profile_cdf_cannot(tmp_path):
    # Expert 1 is hot for a while, then expert 2: an LRU slot follows the phase change, while
    # the static top-1 of the profile (by decode counts) holds expert 1 throughout.
    steps = [[1]] * 6 + [[2]] * 4
    trace = write_trace(tmp_path / "t.trace", steps, policy="lru")
    fill = [(0, 1), (0, 2), (0, 0), (0, 3)]
    replayed = planner.trace_hit_rate(trace, fill=fill)
    # 1 slot holding expert 1: 6 hits, then one miss admits expert 2 and the other 3 hit.
    assert replayed.hit_rate(1) == pytest.approx(9 / 10)
    static = planner.trace_hit_rate(trace, fill=fill, spec=PolicySpec("static"))
    assert static.hit_rate(1) == pytest.approx(6 / 10)
    counts = np.array([[0, 6, 4, 0]])
    cdf = planner.profile_hit_rate(Profile.from_counts(counts, FP, decode_counts=counts))
    assert cdf.hit_rate(1) == pytest.approx(static.hit_rate(1))  # the CDF is the static cache


def test_plan_inverse_bisects_a_replayed_model(tmp_path):
    trace = write_trace(tmp_path / "t.trace", [[0, 1, 2, 3]] * 4)  # hit rate = slots / 4
    hits = planner.trace_hit_rate(trace, fill=[(0, e) for e in range(4)])
    cost = planner.CostModel(0.01, 0.03, 0.0, 1.0)  # 100 tok/s at 100% hits, 25 at 0%
    hw = Hardware(3 * MIB, 4, reserved_bytes=700 * MIB)
    inverse = planner.plan_inverse(hw, 50.0, hits, cost)  # 1 / (0.01 + 0.03 * miss) >= 50
    assert inverse["reachable"] and inverse["slots"] == 3  # miss 0.25 -> 57 tok/s; 0.5 -> 40
    assert not planner.plan_inverse(hw, 150.0, hits, cost)["reachable"]


def test_plan_inverse_finds_the_least_size_when_speed_dips():
    """On a CPU a mid-size dynamic region can decode slower than a small one (it fills more):
    the least size reaching the target can lie before the dip, where a bisection over all
    sizes would not look."""
    def fills(slots: int) -> float:  # 0.3 per lookup at 0 slots, 0.5 at 200, none at 512
        return 0.3 + slots / 1000 if slots <= 200 else 0.5 * (512 - slots) / 312

    calls = []

    def work(slots: int) -> planner.CacheWork:
        calls.append(slots)
        return planner.CacheWork(1 - slots / 512, fills(slots))

    hits = planner.HitRateModel("replayed", lambda s: s / 512, lambda s: "replayed",
                                expensive=True, work=work)
    cost = planner.CostModel(0.002, 0.002, 0.0, 0.5, "linear", "fill")  # 1 / (2 + 2 x fills) ms
    hw = Hardware(3 * MIB, 512, reserved_bytes=700 * MIB)
    # 385 tok/s at 0 slots, 333 at 200, 500 at 512: 380 is reached before the dip (a bisection
    # over 0..512 would answer ~315), 450 only past it, from 443 slots (fills <= 0.111).
    assert planner.plan_inverse(hw, 380.0, hits, cost)["slots"] == 0
    inverse = planner.plan_inverse(hw, 450.0, hits, cost)
    assert inverse["reachable"] and inverse["slots"] == 443
    assert inverse["decode_tok_s"] >= 450.0 > cost.decode_tok_s(0.0, work(442))
    assert not planner.plan_inverse(hw, 501.0, hits, cost)["reachable"]
    assert len(set(calls)) < 40  # a grid and a bisection, not all 513 sizes


def test_cli_replays_a_trace_with_a_profile_as_the_pre_fill(tmp_path, capsys):
    trace_path = tmp_path / "t.trace"
    write_trace(trace_path, [[0, 2]] * 10)
    profile_path = tmp_path / "p.bin"
    Profile.from_counts(np.array([[5, 0, 9, 1]]), FP).write(profile_path)  # ranks 2, 0, 3, 1
    assert plan_main(["--trace", str(trace_path), "--profile", str(profile_path),
                      "--slot-mib", "3", "--pairs", "4", "--free-mib", "703", "706", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(r["slots"], r["hit_rate"]) for r in out["rows"]] == [(1, 0.5), (2, 1.0)]
    assert out["inputs"]["hit_rate_source"] == "replayed"


def test_profile_cdf_uses_decode_counts_when_the_profile_has_them():
    # Prompts routed mostly to expert 0, decode mostly to expert 1; the ranking is by all tokens.
    counts = np.array([[60, 30, 10, 0]])
    decode = np.array([[0, 30, 10, 0]])
    with_decode = planner.profile_hit_rate(Profile.from_counts(counts, FP, decode_counts=decode))
    assert [with_decode.hit_rate(s) for s in range(4)] == pytest.approx([0, 0, 0.75, 1.0])
    assert with_decode.detail == "decode routing counts"
    all_tokens = planner.profile_hit_rate(Profile.from_counts(counts, FP))
    assert all_tokens.hit_rate(1) == pytest.approx(0.6)
    assert "no decode counts" in all_tokens.detail


def test_live_profile_keeps_decode_counts_apart_and_saves_them():
    live = LiveProfile.empty(1, 4, half_life_s=0.0)
    live.observe(np.array([[60, 30, 10, 0]]), 0.0, decode_totals=np.array([[0, 30, 10, 0]]))
    live.observe(np.array([[60, 34, 10, 2]]), 1.0, decode_totals=np.array([[0, 34, 10, 2]]))
    profile = live.to_profile(FP)
    assert [p[:2] for p in profile.ranked] == [(0, 0), (0, 1), (0, 2), (0, 3)]  # by all tokens
    assert profile.decode_counts == (0, 34, 10, 2)
    reloaded = LiveProfile.from_profile(profile, half_life_s=0.0)
    np.testing.assert_array_equal(reloaded.decode_scores, [0, 34, 10, 2])
    # Engines that send no decode counts leave the profile without them (format version 1).
    old = LiveProfile.empty(1, 4, half_life_s=0.0)
    old.observe(np.array([[1, 2, 3, 4]]), 0.0)
    assert old.to_profile(FP).decode_counts is None


def points(hit_speed_pairs):
    return [{"slots": int(100 * h), "hit_rate": h, "decode_tok_s": v}
            for h, v in hit_speed_pairs]


def test_fit_falls_back_to_a_constant_when_the_miss_cost_is_not_significant():
    rng = np.random.default_rng(0)
    # Speed does not depend on the hit rate (a CPU): 90 tok/s +- 15% noise at two hit rates.
    data = [(h, 90.0 * (1 + 0.15 * rng.standard_normal())) for h in [0.5] * 12 + [0.98] * 12]
    model, error = fit_cost_model(points(data))
    assert model.form == "constant" and model.per_miss_s == 0.0
    assert model.base_s == pytest.approx(float(np.median([1 / v for _, v in data])))
    assert not error["miss_cost"]["significant"]
    lo, hi = error["miss_cost"]["ci95_s"]
    assert lo < 0 < hi or error["miss_cost"]["per_miss_s"] <= 0
    assert "not significant" in error["fallback"] or "not positive" in error["fallback"]
    # The prediction is the median speed whatever the hit rate, not a wild extrapolation.
    assert model.decode_tok_s(0.0) == model.decode_tok_s(1.0) == pytest.approx(1 / model.base_s)
    assert model.basis(0.75) == "fitted" and model.basis(0.0) == "extrapolated"


def test_fit_refuses_a_negative_miss_cost():
    data = [(0.5, 100.0), (0.5, 101.0), (0.6, 99.0), (0.9, 90.0), (0.9, 91.0), (0.95, 89.0)]
    model, error = fit_cost_model(points(data))  # faster with *more* misses: not physical
    assert model.form == "constant" and "not positive" in error["fallback"]
    assert error["miss_cost"]["per_miss_s"] < 0


def test_fit_keeps_a_significant_miss_cost():
    base_s, per_miss_s = 0.005, 0.05
    rng = np.random.default_rng(1)
    data = [(h, 1 / (base_s + per_miss_s * (1 - h)) * (1 + 0.02 * rng.standard_normal()))
            for h in [0.4] * 8 + [0.9] * 8]
    model, error = fit_cost_model(points(data))
    assert model.form == "linear" and error["fallback"] is None
    assert model.per_miss_s == pytest.approx(per_miss_s, rel=0.15)
    assert error["miss_cost"]["ci95_s"][0] > 0


def test_stored_fit_says_which_model_and_why(tmp_path):
    speeds = {16: [88.0, 95.0, 91.0, 86.0], 48: [93.0, 87.0, 90.0, 94.0]}
    paths = []
    for slots, v in speeds.items():
        requests = [{"ok": True, "hit_rate": 0.4 if slots == 16 else 0.9, "decode_tok_s": s}
                    for s in v]
        path = tmp_path / f"run-{slots}.json"
        path.write_text(json.dumps({"engine": {"slots": slots, "slot_bytes": 3 * MIB,
                                               "total_pairs": 64, "reserved_bytes": 700 * MIB},
                                    "cases": [{"name": "short_decode", "requests": requests}]}))
        paths.append(path)
    fit = fit_results(paths)
    cost = fit["cost_model"]
    assert fit["version"] == 2 and cost["model"] == "constant" and cost["per_miss_s"] == 0.0
    assert cost["basis"].startswith("constant") and "includes 0" in cost["basis"]
    assert planner.CostModel.from_dict(cost).form == "constant"
    # Fits stored before the fallback existed (no "model" key) still load as linear.
    old = {k: v for k, v in cost.items() if k != "model"}
    assert planner.CostModel.from_dict(old).form == "linear"


def test_median_line_ignores_a_tail_of_slow_outliers():
    rng = np.random.default_rng(2)
    x = np.repeat([0.1, 0.5, 0.9], 30)
    y = 0.006 + 0.002 * x + 1e-5 * rng.standard_normal(x.size)
    y[::5] += 0.02  # every fifth request stalled behind other work on the machine
    line = fit_median_line(x, y)
    assert line.slope == pytest.approx(0.002, rel=0.05)
    assert line.intercept == pytest.approx(0.006, rel=0.01)
    two = fit_median_line([0.0, 0.0, 0.0, 1.0, 1.0, 1.0], [1.0, 2.0, 9.0, 3.0, 4.0, 9.0])
    assert (two.intercept, two.slope) == (2.0, 2.0)  # through the two groups' medians


def write_counted_result(path, slots: int, hit: float, fills: float, decode_tok_s: float,
                         device: str | None = None):
    """A bench result with the engine's decode counters over 10,000 lookups (fills per lookup
    split between demand and prefetch) and five identical short decodes."""
    lookups, num_fills = 10_000, round(fills * 10_000)
    engine = {"slots": slots, "slot_bytes": 3 * MIB, "total_pairs": 512,
              "reserved_bytes": 700 * MIB, **({"device": device} if device else {})}
    path.write_text(json.dumps({
        "engine": engine,
        "decode_counters": {"lookups": lookups, "hits": round(hit * lookups),
                            "demand_fills": num_fills // 2,
                            "prefetch_fills": num_fills - num_fills // 2},
        "cases": [{"name": "short_decode", "requests": [
            {"ok": True, "hit_rate": hit, "decode_tok_s": decode_tok_s}] * 5}]}))
    return path


def test_fit_on_cache_work_when_the_results_carry_fill_counters(tmp_path):
    # s/token = 6 ms + 1 ms x cache work; the 20% budget misses less but fills more than the
    # 6% one, so it is *slower* than its miss rate says: only the work explains both.
    budgets = {32: (0.40, 0.95), 106: (0.76, 1.10), 362: (0.99, 0.06)}  # slots: hit, work
    paths = {slots: write_counted_result(tmp_path / f"acc-{slots}.json", slots, hit,
                                         fills=work - (1 - hit),
                                         decode_tok_s=1 / (0.006 + 0.001 * work))
             for slots, (hit, work) in budgets.items()}
    fit = fit_results([paths[32], paths[362]])
    cost = planner.CostModel.from_dict(fit["cost_model"])
    assert (cost.form, cost.driver) == ("linear", "work")
    assert cost.per_miss_s == pytest.approx(0.001, rel=1e-6)
    assert "cache_work" in fit["cost_model"]["form"]
    # The 20% budget predicted from its replayed work, not its miss rate.
    assert cost.decode_tok_s(0.76, work=planner.CacheWork(0.24, 0.86)) == pytest.approx(
        1 / 0.0071)
    assert cost.decode_tok_s(0.76) == pytest.approx(1 / (0.006 + 0.001 * 0.24))  # miss rate
    assert cost.basis(0.76) == "extrapolated"  # the miss rate standing in for the work


def test_replay_reports_the_cache_work_and_plan_row_uses_it(tmp_path):
    # LRU with 1 slot on 0,0,1,1,0,0: misses at steps 1, 3, 5, each admitted (a fill).
    trace = write_trace(tmp_path / "t.trace", [[0], [0], [1], [1], [0], [0]], policy="lru")
    model = planner.trace_hit_rate(trace, fill=[])
    assert model.hit_rate(1) == pytest.approx(3 / 6)
    assert model.work(1) == planner.CacheWork(3 / 6, 3 / 6)  # 3 misses, 3 fills, 6 lookups
    hw = Hardware(3 * MIB, 4, reserved_bytes=700 * MIB)
    for driver, x in (("work", 1.0), ("fill", 0.5)):
        cost = planner.CostModel(0.005, 0.003, 0.0, 1.0, "linear", driver)
        row = planner.plan_row(hw, 700 * MIB + 3 * MIB, model, cost)
        assert row["decode_tok_s"] == pytest.approx(1 / (0.005 + 0.003 * x), rel=1e-4)
        assert row["basis"]["decode_driver"] == driver
        assert row["basis"]["decode_model"] == "linear"


def test_an_engine_on_the_cpu_is_fitted_on_its_fills(tmp_path):
    """On a CPU a miss is read in place at the speed of a hit: decode time follows the fills.
    Here s/token = 1.5 ms + 1.3 ms x fills per lookup, whatever the misses; a fit on two
    budgets predicts the third from its fills, where misses + fills would be off."""
    budgets = {32: (0.40, 0.37), 106: (0.75, 0.54), 362: (0.99, 0.05)}  # slots: hit, fills
    paths = {slots: write_counted_result(tmp_path / f"cpu-{slots}.json", slots, hit, fills,
                                         decode_tok_s=1 / (0.0015 + 0.0013 * fills),
                                         device="cpu")
             for slots, (hit, fills) in budgets.items()}
    fit = fit_results([paths[32], paths[362]])
    cost = planner.CostModel.from_dict(fit["cost_model"])
    assert (cost.form, cost.driver) == ("linear", "fill")
    assert cost.per_miss_s == pytest.approx(0.0013, rel=1e-6)
    assert "fill_rate" in fit["cost_model"]["form"]
    work = planner.CacheWork(0.25, 0.54)  # the 106-slot budget, as a replay would give it
    assert cost.decode_tok_s(0.75, work) == pytest.approx(1 / (0.0015 + 0.0013 * 0.54))
    assert cost.basis(0.75, work) == "extrapolated"  # more fills than either fit budget
    assert planner.fit_driver("cuda:0", True) == "work"
    assert planner.fit_driver("cpu", False) == "miss"


def test_gzipped_traces_read_like_plain_ones(tmp_path):
    plain = tmp_path / "t.trace"
    trace = write_trace(plain, [[0, 2]] * 3)
    packed = tmp_path / "t.trace.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    again = planner.read_trace(packed)
    assert again.meta == trace.meta and len(again.records) == len(trace.records)
