"""`strata cache profile|replay` and `strata bench cache` on a tiny checkpoint."""

from __future__ import annotations

import json

import pytest

from services.cachetools import bench_cmd, profile_cmd, replay_cmd
from services.common.profile import Profile, ProfileError
from services.engine.cache.trace import Trace
from services.engine.planning import local_plan


def test_profile_from_a_trace_is_accepted_by_the_engine(live_trace, tmp_path, capsys, caplog):
    path, runner = live_trace
    out = tmp_path / "expert-profile.bin"
    assert profile_cmd.main([str(path), "-o", str(out), "--slots", "6", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    profile = Profile.read(out)
    assert summary["pairs"] == len(profile.ranked) == 24 and profile.built_for_slots == 6
    assert (profile.counts() == Trace.read(path).routing_counts()).all()
    caplog.set_level("INFO", logger="strata.engine")
    plan = local_plan(runner, str(out))
    assert plan.source == "profile" and plan.pairs[0] == profile.top_pairs(1)[0]
    assert "24 ranked pairs, built for 6 slots" in caplog.text
    foreign = Profile(fingerprint="0" * 16, num_layers=3, num_experts=8, ranked=profile.ranked)
    foreign.write(tmp_path / "foreign.bin")
    with pytest.raises(ProfileError, match="another model"):
        local_plan(runner, str(tmp_path / "foreign.bin"))


def test_profile_cli_reports_unreadable_traces(tmp_path, capsys):
    (tmp_path / "junk").write_bytes(b"not a trace at all")
    assert profile_cmd.main([str(tmp_path / "junk"), "-o", str(tmp_path / "p.bin")]) == 1
    assert "not a routing trace" in capsys.readouterr().err


def test_replay_reproduces_the_live_hit_rate(live_trace, capsys):
    path, runner = live_trace
    live = runner.cache.decode
    assert replay_cmd.main([str(path), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["lookups"], got["hits"], got["slots"]) == (live.lookups, live.hits, 6)
    assert got["hit_rate"] == live.hit_rate and got["belady"] >= got["hit_rate"] - 0.05
    assert replay_cmd.main([str(path), "--slots", "12", "--policy", "lru"]) == 0
    line = capsys.readouterr().out
    assert "12 slots (coverage 50.0%), policy lru" in line and "Belady (MIN)" in line


def test_replay_sweep_and_plot(live_trace, tmp_path, capsys):
    path, _ = live_trace
    png = tmp_path / "sweep.png"
    assert replay_cmd.main([str(path), "--sweep", "--json", "--plot", str(png)]) == 0
    points = json.loads(capsys.readouterr().out)["points"]
    assert [p["slots"] for p in points][-1] == 24 and len(points) == 20
    assert points[-1]["hit_rate"] == points[-1]["belady"] == 1.0
    oracle = [p["belady"] for p in points]
    assert oracle == sorted(oracle)  # MIN never loses from more slots
    assert all(p["belady"] >= max(p["static"], p["lru"]) - 1e-12 for p in points)
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_bench_cache_json_shape(tools_model, tmp_path, capsys):
    png = tmp_path / "bench.png"
    argv = ["--model", str(tools_model), "--prompts", "2", "--max-tokens", "12", "--json",
            "--plot", str(png)]
    assert bench_cmd.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["coverage"] and list(out["coverage"]) == ["0.1", "0.25", "0.5"]
    for row in out["coverage"].values():
        assert list(row) == ["static", "lru", "demand", "default", "belady"]
        assert all(0.0 <= v <= 1.0 for v in row.values())
        assert row["belady"] >= max(row["static"], row["lru"])
    assert png.exists()


@pytest.mark.parametrize("text", ["topics", "stdlib"])
def test_prompt_sets_are_disjoint(text):
    a, b = bench_cmd.prompt_sets(24, text)
    assert len(a) == len(b) == 24 and not set(a) & set(b)
    if text == "stdlib":  # snippets of distinct files
        assert len(set(a)) == len(set(b)) == 24


def test_bench_cache_runs_on_a_qwen3_next_shaped_model(tmp_path, capsys):
    """The reference deployment's shape: 48 layers (36 Gated DeltaNet, 12 attention) x 512
    experts, 10 routed + 1 shared (tiny widths): its 24,576 pairs profiled, replayed and
    compared across policies."""
    pytest.importorskip("transformers")
    from tests.engine.test_model_families import make_family_checkpoint

    model_dir, _ = make_family_checkpoint(
        tmp_path / "qwen3-next-shaped", "qwen3_next", num_hidden_layers=48, layer_types=None,
        num_experts=512, num_experts_per_tok=10, hidden_size=32, moe_intermediate_size=8,
        shared_expert_intermediate_size=8, intermediate_size=32, num_attention_heads=2,
        num_key_value_heads=1, linear_num_key_heads=1, linear_num_value_heads=2,
        max_position_embeddings=512)
    from services.engine.model.checkpoint import load_model_config

    config = load_model_config(model_dir)
    assert config.total_pairs == 24576 and len(config.linear_layers) == 36
    argv = ["--model", str(model_dir), "--prompts", "2", "--max-tokens", "6", "--json"]
    assert bench_cmd.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    for row in out["coverage"].values():
        assert row["belady"] >= max(row["static"], row["lru"]) > 0
