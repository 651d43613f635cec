"""The random-weight demo checkpoint: deterministic, written under $STRATA_HOME, loads in Strata."""

from __future__ import annotations

import json

import torch
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


def test_a_large_checkpoint_is_written_shard_by_shard_with_the_same_weights(tmp_path,
                                                                             monkeypatch):
    """Over SHARD_BYTES: the embeddings and lm_head, then one shard per layer, an index, the
    config's torch_dtype; the same tensors as the one-file checkpoint, and it loads."""
    from services.engine.model.checkpoint import CheckpointReader

    small = {"num_hidden_layers": 2, "torch_dtype": "bfloat16"}
    one = demo.write_demo_checkpoint(tmp_path / "one", seed=3, **small)
    monkeypatch.setattr(demo, "SHARD_BYTES", 1)
    lines = []
    sharded = demo.write_demo_checkpoint(tmp_path / "sharded", seed=3, progress=lines.append,
                                         **small)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert lines[-1].startswith("demo checkpoint: wrote shard 3/3")
    want = load_file(one / "model.safetensors")
    got = {k: v for f in sorted(sharded.glob("model-*.safetensors")) for k, v in
           load_file(f).items()}
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert all(v.dtype == torch.bfloat16 for v in got.values())
    config = json.loads((one / "config.json").read_text())
    assert demo.demo_bytes(config, torch.bfloat16) == sum(
        v.numel() * v.element_size() for v in want.values())
    reader = CheckpointReader(sharded)
    assert reader.num_files == 3 and len(reader.names) == len(want)
    runner = ModelRunner(sharded, cache_slots=4, reserved_bytes=0)
    assert runner.weight_dtype == torch.bfloat16 and runner.slots == 4


def test_strata_model_demo_layers_overrides_the_presets_and_refuses_a_count_below_one(
        tmp_path, capsys):
    import pytest

    from services.cli import main

    out = tmp_path / "two"
    assert main(["model", "demo", "--layers", "2", "--output", str(out), "--json"]) == 0
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["model", "demo", "--layers", "0", "--output", str(tmp_path / "none")])
    assert "--layers" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()
