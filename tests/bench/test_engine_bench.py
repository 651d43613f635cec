"""`strata bench engine` on a tiny demo checkpoint: JSON keys present and sane, HF comparison."""

from __future__ import annotations

import json

import pytest

from services.bench import engine_bench
from services.engine.model.demo import PRESETS, write_demo_checkpoint

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_experts=8, num_experts_per_tok=2, max_position_embeddings=128)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("bench") / "tiny", **TINY)


def run_json(capsys, argv: list[str]) -> dict:
    assert engine_bench.main([*argv, "--json", "--repeat", "1"]) == 0
    return json.loads(capsys.readouterr().out)


def test_bench_engine_json(tiny_model, capsys, monkeypatch):
    monkeypatch.setattr(engine_bench, "BANDWIDTH_BYTES", 16 * 2**20)
    r = run_json(capsys, ["--model", str(tiny_model), "--prompt-tokens", "8", "--gen-tokens",
                          "4", "--batch", "2"])
    for key in ("decode_tok_s", "prefill_tok_s", "bandwidth_bound_tok_s", "bandwidth_gb_s",
                "active_bytes_per_token"):
        assert r[key] > 0, key
    expert_bytes = 3 * 64 * 32 * 4
    # Two sequences share one read of the non-expert weights and of each distinct expert.
    assert 1 <= r["distinct_experts_per_layer_step"] <= 4
    assert r["active_bytes_per_token"] == pytest.approx(
        (r["non_expert_bytes_per_step"] + r["distinct_experts_per_layer_step"] * 2 * expert_bytes)
        / 2)
    assert r["bandwidth_bound_tok_s"] == pytest.approx(
        r["bandwidth_gb_s"] * 1e9 / r["active_bytes_per_token"])
    assert "hf_decode_tok_s" not in r
    on_disk = sum(f.stat().st_size for f in tiny_model.glob("*.safetensors"))
    assert r["model_file_bytes"] == on_disk > 0
    assert r["peak_rss_bytes"] > on_disk and r["kv_bytes"] > 0
    assert "peak RSS" in engine_bench.render(r)


def test_bench_engine_compare_hf(tiny_model, capsys, monkeypatch):
    monkeypatch.setattr(engine_bench, "BANDWIDTH_BYTES", 16 * 2**20)
    r = run_json(capsys, ["--model", str(tiny_model), "--prompt-tokens", "6", "--gen-tokens",
                          "4", "--compare-hf"])
    assert r["hf_decode_tok_s"] > 0
    assert r["hf_ratio"] == pytest.approx(r["decode_tok_s"] / r["hf_decode_tok_s"])
    assert r["hf_tokens_match"] is True


def test_bench_preset_shape():
    bench = PRESETS["bench"]
    assert (bench["hidden_size"], bench["num_hidden_layers"], bench["num_experts"],
            bench["num_experts_per_tok"], bench["moe_intermediate_size"],
            bench["vocab_size"]) == (512, 8, 64, 8, 256, 32000)
    with pytest.raises(ValueError, match="unknown preset"):
        write_demo_checkpoint("/nonexistent", preset="huge")


def test_coverage_and_prefetch_sweep_reports_the_spill_penalty(tiny_model, capsys, monkeypatch,
                                                                tmp_path):
    monkeypatch.setattr(engine_bench, "BANDWIDTH_BYTES", 16 * 2**20)
    out = run_json(capsys, ["--model", str(tiny_model), "--prompt-tokens", "6", "--gen-tokens",
                            "5", "--coverage", "1", "0.25", "--prefetch", "off", "on",
                            "--policy", "static", "--out", str(tmp_path / "report")])
    runs = out["runs"]
    assert [(r["prefetch"], r["coverage"]) for r in runs] == [
        (False, 1.0), (False, 0.25), (True, 1.0), (True, 0.25)]
    for r in runs:  # static residency: every miss of the uncached pairs is spill
        assert r["decode_spill"] == pytest.approx(1 - r["decode_hit_rate"])
        assert (r["decode_spill"] == 0) == (r["coverage"] == 1.0) and r["decode_spill"] < 1
        assert r["device"] == "cpu" and r["cuda_graphs"] is False
    for key in ("prefetch_off", "prefetch_on"):  # tok/s lost per point: the fitted slope
        full, part = (r for r in runs if r["prefetch"] == (key == "prefetch_on"))
        assert out["spill_penalty"][key] == pytest.approx(
            (full["decode_tok_s"] - part["decode_tok_s"]) / (100 * part["decode_spill"]))
    md = (tmp_path / "report" / "engine.md").read_text()
    assert "Spill penalty, prefetch off" in md and "engine-spill.png" in md
    assert (tmp_path / "report" / "engine-spill.png").stat().st_size > 0
    assert engine_bench.main(["--from-json", str(tmp_path / "report" / "engine.json"),
                              "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "engine.md").read_text() == md
