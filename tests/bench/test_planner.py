"""Capacity planner: slot arithmetic, hit-rate sources, the cost-model fit, the inverse."""

from __future__ import annotations

import json

import numpy as np
import pytest

from services.bench import planner
from services.bench.fit import fit_cost_model, fit_results
from services.bench.plan_cli import plan_main
from services.bench.planner import MIB, CostModel, Hardware
from services.common.profile import Profile

ROW_KEYS = {"free_mib", "slots", "cache_gib", "coverage", "hit_rate", "decode_tok_s", "basis"}


def test_slot_arithmetic_for_explicit_inputs():
    slot_bytes = round(1.318 * MIB)  # the reference 125B model's 2-bit expert
    hw = Hardware(slot_bytes, 24_576, reserved_bytes=700 * MIB, draft_bytes=184 * MIB)
    row = planner.plan_row(hw, 8192 * MIB, None, None)
    assert row["slots"] == (8192 - 700 - 184) * MIB // slot_bytes == 5544
    assert row["coverage"] == pytest.approx(5544 / 24_576, abs=1e-6)
    assert row["cache_gib"] == pytest.approx(5544 * slot_bytes / 2**30, abs=1e-4)
    assert row["basis"]["slots"] == "measured" and row["hit_rate"] is None
    assert planner.plan_row(hw, 800 * MIB, None, None)["slots"] == 0  # less than the overhead
    assert planner.plan_row(hw, 64 * 2**30, None, None)["slots"] == 24_576  # capped at all pairs


def test_cli_json_shape_with_several_free_sizes(capsys):
    assert plan_main(["--free-mib", "8192", "16384", "--slot-mib", "1.318", "--pairs", "24576",
                      "--reserved-mib", "700", "--draft-mib", "184", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["slots"] for r in out["rows"]] == [5544, 11760]
    assert all(set(r) == ROW_KEYS for r in out["rows"])
    assert [r["free_mib"] for r in out["rows"]] == [8192, 16384]


def test_profile_cumulative_distribution_gives_the_hit_rate():
    counts = np.array([[50, 0, 10], [30, 5, 5]])  # 100 lookups; hottest 50, 30, 10, 5, 5, 0
    model = planner.profile_hit_rate(Profile.from_counts(counts, "f" * 16))
    assert [model.hit_rate(s) for s in range(7)] == pytest.approx([0, .5, .8, .9, .95, 1, 1])
    assert model.basis(3) == "fitted"


def test_measured_hit_rate_interpolates_and_says_where_it_extrapolates():
    model = planner.measured_hit_rate([(50, 0.3), (150, 0.7), (150, 0.72)], total_pairs=200)
    assert model.hit_rate(150) == pytest.approx(0.71)  # median of the two measurements
    assert model.hit_rate(100) == pytest.approx((0.3 + 0.71) / 2)
    assert model.hit_rate(200) == pytest.approx(1.0) and model.hit_rate(0) == 0.0
    assert [model.basis(s) for s in (150, 100, 20, 180)] == [
        "measured", "fitted", "extrapolated", "extrapolated"]


def test_fit_reproduces_a_known_linear_relation():
    base_s, per_miss_s = 0.004, 0.020  # s/token = 4 ms + 20 ms x miss rate
    points = [{"slots": s, "hit_rate": h, "decode_tok_s": 1 / (base_s + per_miss_s * (1 - h))}
              for s, h in [(10, 0.5), (20, 0.7), (30, 0.9), (30, 0.95)]]
    model, error = fit_cost_model(points)
    assert model.base_s == pytest.approx(base_s) and model.per_miss_s == pytest.approx(per_miss_s)
    assert error["rms_rel_error"] < 1e-9 and error["num_points"] == 4
    assert (model.miss_lo, model.miss_hi) == pytest.approx((0.05, 0.5))
    assert model.decode_tok_s(1.0) == pytest.approx(250.0)
    assert model.basis(0.8) == "fitted" and model.basis(0.99) == "extrapolated"


def make_hw_and_models():
    counts = np.arange(64, 0, -1).reshape(4, 16) ** 2  # a long tail
    hits = planner.profile_hit_rate(Profile.from_counts(counts, "f" * 16))
    cost = CostModel(base_s=0.005, per_miss_s=0.05, miss_lo=0.0, miss_hi=1.0)
    return Hardware(3 * MIB, 64, reserved_bytes=700 * MIB), hits, cost


@pytest.mark.parametrize("target", [60.0, 100.0, 150.0, 199.0])
def test_inverse_is_consistent_with_the_forward_table(target):
    hw, hits, cost = make_hw_and_models()
    inverse = planner.plan_inverse(hw, target, hits, cost)
    assert inverse["reachable"]
    forward = planner.plan_row(hw, inverse["free_bytes"], hits, cost)
    assert forward["slots"] == inverse["slots"]
    assert forward["decode_tok_s"] >= target
    one_less = planner.plan_row(hw, inverse["free_bytes"] - 1, hits, cost)
    assert one_less["slots"] == inverse["slots"] - 1 and one_less["decode_tok_s"] < target
    for row in planner.plan_table(hw, planner.default_free_sizes(hw), hits, cost):
        assert (row["decode_tok_s"] >= target) == (row["slots"] >= inverse["slots"])


def test_inverse_says_when_a_target_is_out_of_reach():
    hw, hits, cost = make_hw_and_models()
    inverse = planner.plan_inverse(hw, 1000.0, hits, cost)
    assert not inverse["reachable"] and inverse["best_decode_tok_s"] == pytest.approx(200.0)


def bench_result(slots: int, hit_rates: list[float], speeds: list[float]) -> dict:
    requests = [{"ok": True, "hit_rate": h, "decode_tok_s": s}
                for h, s in zip(hit_rates, speeds, strict=True)]
    return {"bench": "run", "engine": {"model": "m", "slots": slots, "slot_bytes": 3 * MIB,
                                       "total_pairs": 64, "reserved_bytes": 700 * MIB,
                                       "device_memory_bytes": 700 * MIB + slots * 3 * MIB},
            "cases": [{"name": "short_decode", "requests": requests},
                      {"name": "prefill_1_2_window", "requests": [
                          {"ok": True, "hit_rate": 0.1, "decode_tok_s": 1.0}]}]}


def test_fit_files_then_plan_marks_every_number(tmp_path, capsys):
    speed = lambda h: 1 / (0.005 + 0.05 * (1 - h))  # noqa: E731
    paths = []
    for slots, rates in ((16, [0.40, 0.42]), (48, [0.80, 0.82])):
        path = tmp_path / f"run-{slots}.json"
        path.write_text(json.dumps(bench_result(slots, rates, [speed(h) for h in rates])))
        paths.append(path)
    fit = fit_results(paths)
    assert fit["cost_model"]["per_miss_s"] == pytest.approx(0.05)
    assert fit["hit_points"] == [[16, pytest.approx(0.41)], [48, pytest.approx(0.81)]]
    fit_path = tmp_path / "fit.json"
    assert plan_main(["fit", *map(str, paths), "--output", str(fit_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["error"]["rms_rel_error"] < 1e-9
    free = [700 + 16 * 3, 700 + 32 * 3, 700 + 60 * 3]
    assert plan_main(["--fit", str(fit_path), "--free-mib", *map(str, free),
                      "--target-tok-s", "100", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    bases = [(r["basis"]["hit_rate"], r["basis"]["decode_tok_s"]) for r in out["rows"]]
    assert bases == [("measured", "fitted"), ("fitted", "fitted"),
                     ("extrapolated", "extrapolated")]
    assert out["rows"][1]["hit_rate"] == pytest.approx(0.61)
    assert out["target"]["reachable"] and out["target"]["decode_tok_s"] >= 100
