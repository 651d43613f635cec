"""The written checkpoint: files, keys, dtype; served by Strata's ModelRunner and by transformers'
Qwen3MoeForCausalLM with the same logits; the training module computes the same function."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from services.engine.driver import SequenceDriver
from services.engine.runner import ModelRunner
from services.training.cli import main
from services.training.config import TrainConfig
from services.training.moe import MoETransformer
from tests.training.conftest import TINY

PROMPT = "<|im_start|>user\nWrite a function.<|im_end|>\n<|im_start|>assistant\ndef parse(self"


def load_trained(model_dir) -> tuple[MoETransformer, list[str]]:
    """The training module with the checkpoint's (bf16 -> fp32) weights; per-expert keys stacked."""
    model = MoETransformer(TINY, 300)
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        state = {}
        for name in model.state_dict():
            prefix, _, leaf = name.rpartition(".")
            if prefix.endswith(".mlp.experts"):
                parts = [f.get_tensor(f"{prefix}.{e}.{leaf}.weight") for e in range(TINY.experts)]
                state[name] = torch.stack(parts).float()
            else:
                state[name] = f.get_tensor(name).float()
    model.load_state_dict(state)
    return model.eval(), names


def test_checkpoint_files_and_keys(tiny_run):
    model_dir, _ = tiny_run
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "README.md",
        "training_summary.json",
    ):
        assert (model_dir / name).is_file(), name
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe"
    assert config["num_experts"] == config["num_local_experts"] == TINY.experts
    assert config["vocab_size"] == 300 and config["eos_token_id"] == 2
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tok_config["eos_token"] == "<|im_end|>" and "<|im_start|>" in tok_config["chat_template"]
    _, names = load_trained(model_dir)
    assert "model.layers.1.mlp.gate.weight" in names
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names
    assert not any(n.endswith(("experts.gate_proj", "experts.down_proj")) for n in names)
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(n).dtype for n in f.keys()} == {torch.bfloat16}  # noqa: SIM118


def test_strata_transformers_and_training_module_agree(tiny_run):
    from transformers import Qwen3MoeForCausalLM

    model_dir, _ = tiny_run
    ref = Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ours, _ = load_trained(model_dir)
    runner = ModelRunner(model_dir, cache_slots=0, reserved_bytes=0)
    drive = SequenceDriver(runner)
    ids = runner.tokenizer.encode(PROMPT)
    assert 10 < len(ids) < TINY.context
    seq = drive.start(ids)
    logits = drive.prefill(seq)
    for step in range(5):
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0, -1]
            trained = ours(torch.tensor([ids])).logits[0, -1]
        assert (logits - want).abs().max().item() <= 1e-3, f"step {step}: Strata vs transformers"
        assert (trained - want).abs().max().item() <= 1e-3, f"step {step}: training vs transformers"
        token = int(want.argmax())
        ids.append(token)
        logits = drive.decode(seq, token)
    runner.close()


def test_model_card_reports_heldout_loss_and_routing(tiny_run):
    model_dir, summary = tiny_run
    card = (model_dir / "README.md").read_text()
    held = summary["heldout"]
    assert f"loss **{held['loss']:.4f}**" in card
    assert "unigram" in card and "zlib.crc32(name) % 12" in card
    assert "| 1 |" in card  # one routing row per layer
    assert held["num_tokens"] > 0 and held["unigram_perplexity"] > 1
    layers = summary["routing"]["layers"]
    assert len(layers) == TINY.layers and all(0 < x["entropy_ratio"] <= 1 for x in layers)
    assert summary["train"]["steps_done"] == TINY.steps
    assert summary["train"]["final_loss"] < summary["train"]["first_loss"]


def test_cli_writes_a_checkpoint_and_prints_json(tmp_path, capsys):
    out = tmp_path / "cli-run"
    argv = [
        "--output",
        str(out),
        "--layers",
        "1",
        "--experts",
        "4",
        "--top-k",
        "2",
        "--hidden",
        "32",
        "--expert-ffn",
        "16",
        "--context",
        "32",
        "--vocab",
        "280",
        "--batch",
        "2",
        "--tokens",
        "100",
        "--threads",
        "1",
        "--eval-tokens",
        "64",
        "--corpus-max-bytes",
        "20000",
        "--json",
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert summary["train"]["steps_done"] == 2  # ceil(100 / (2 * 32))
    assert "losses" not in summary["train"]
    assert "step 2/2" in captured.err and "ETA" in captured.err and "budget" in captured.err
    assert (out / "model.safetensors").is_file()


@pytest.mark.parametrize(
    "bad",
    [["--top-k", "9", "--experts", "8"], ["--vocab", "100"], ["--hidden", "40"], ["--steps", "0"]],
)
def test_cli_rejects_bad_settings(bad, capsys):
    with pytest.raises(SystemExit) as e:
        main(bad)
    assert e.value.code == 2


def test_default_recipe_is_the_documented_one():
    cfg = TrainConfig()
    assert (cfg.layers, cfg.experts, cfg.top_k) == (8, 64, 8)
    assert cfg.num_heads * cfg.head_dim == cfg.hidden and cfg.num_heads % cfg.num_kv_heads == 0
