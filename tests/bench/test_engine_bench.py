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
