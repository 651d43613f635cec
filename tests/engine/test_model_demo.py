"""The random-weight demo checkpoint: deterministic, written under $STRATA_HOME, loads in Strata."""

from __future__ import annotations

import json

from safetensors.torch import load_file

from services.engine.driver import SequenceDriver
from services.engine.model import demo
from services.engine.runner import ModelRunner


def test_demo_checkpoint_shape_and_determinism(tmp_path, demo_dir):
    cfg = json.loads((demo_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["num_experts"] == 32
    assert (cfg["num_hidden_layers"], cfg["num_experts_per_tok"], cfg["hidden_size"]) == (8, 4, 256)
    assert (cfg["moe_intermediate_size"], cfg["num_attention_heads"], cfg["head_dim"]) == (
        128,
        4,
        64,
    )
    assert cfg["num_key_value_heads"] == 2 and cfg["max_position_embeddings"] == 4096
    small = dict(num_hidden_layers=1, num_experts=4)
    a = load_file(demo.write_demo_checkpoint(tmp_path / "a", **small) / "model.safetensors")
    b = load_file(demo.write_demo_checkpoint(tmp_path / "b", **small) / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    w = a["model.layers.0.mlp.experts.3.up_proj.weight"]
    assert w.dtype.is_floating_point and 0.015 < w.std().item() < 0.025


def test_strata_model_demo_writes_presets_under_strata_home(tmp_path, monkeypatch, capsys):
    from services.cli import main

    monkeypatch.setenv("STRATA_HOME", str(tmp_path / "home"))
    assert demo.strata_home() == tmp_path / "home"
    assert demo.demo_model_dir() == tmp_path / "home" / "models" / "strata-demo-moe"
    assert demo.demo_model_dir("bench").name == "strata-bench-moe"
    assert main(["model", "demo", "--json"]) == 0
    written = json.loads(capsys.readouterr().out)
    assert written["path"] == str(demo.demo_model_dir()) and written["preset"] == "demo"
    assert (demo.demo_model_dir() / "tokenizer.json").is_file()


def test_demo_runs_in_strata(demo_dir):
    runner = ModelRunner(demo_dir, cache_slots=64, reserved_bytes=0)
    drive = SequenceDriver(runner)
    assert (runner.slots, runner.total_pairs) == (64, 256)
    assert runner.model_name == "strata-demo-moe"
    tok = runner.tokenizer
    assert tok.eos_token_ids == {256, 258}
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
    seq = drive.start(ids)
    logits = drive.prefill(seq)
    assert logits.shape == (512,) and logits[:259].std() > 0.05  # not degenerate
