"""ModelConfig parsing (both spellings), checkpoint errors and the fingerprint."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.common.settings import ConfigError, resolve
from services.engine.config import SETTINGS
from services.engine.driver import SequenceDriver
from services.engine.model.checkpoint import CheckpointReader, load_model_config
from services.engine.model.config import CheckpointError
from services.engine.model.demo import DEMO_CONFIG, write_demo_checkpoint
from services.engine.model.dtypes import resolve_dtype
from services.engine.model.families import parse_config
from services.engine.runner import ModelRunner

NEW_STYLE = {
    **DEMO_CONFIG,
    "num_local_experts": 32,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
}
for _key in ("num_experts", "rope_theta"):
    NEW_STYLE.pop(_key)


def test_both_spellings_give_the_same_config():
    old, new = parse_config(DEMO_CONFIG), parse_config(NEW_STYLE)
    assert old == new
    assert old.num_experts == 32 and old.rope_theta == 1e6 and old.context_window == 4096
    assert old.num_layers == 8 and old.experts_per_token == 4 and old.head_dim == 64
    assert old.total_pairs == 256 and old.moe_layers == tuple(range(8))


def test_dense_layers_and_head_dim_default():
    raw = {**DEMO_CONFIG, "mlp_only_layers": [0, 5], "decoder_sparse_step": 2}
    raw.pop("head_dim")
    cfg = parse_config(raw)
    assert cfg.head_dim == 256 // 4
    assert cfg.moe_layers == (1, 3, 7)
    assert cfg.total_pairs == 3 * 32


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"model_type": "llama"}, "'llama'"),
        ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0}}, "longrope"),
        ({"hidden_act": "gelu"}, "gelu"),
    ],
)
def test_unsupported_configs_are_named(patch, message):
    with pytest.raises(CheckpointError, match=message):
        parse_config({**DEMO_CONFIG, **patch})


def test_missing_files_are_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(DEMO_CONFIG))
    with pytest.raises(CheckpointError, match="safetensors"):
        CheckpointReader(tmp_path)


def test_fingerprint_is_stable_and_sensitive(tmp_path):
    a = write_demo_checkpoint(tmp_path / "a", num_hidden_layers=1, num_experts=4)
    b = write_demo_checkpoint(tmp_path / "b", num_hidden_layers=1, num_experts=4, seed=7)
    c = write_demo_checkpoint(tmp_path / "c", num_hidden_layers=1, num_experts=4, rms_norm_eps=1e-5)
    fp = [CheckpointReader(d).fingerprint(load_model_config(d)) for d in (a, b, c)]
    assert len(fp[0]) == 16 and int(fp[0], 16) >= 0
    assert fp[0] == fp[1]  # identifies the checkpoint's structure, not its random values
    assert fp[0] != fp[2]


def _tiny(path, **overrides):
    return write_demo_checkpoint(
        path,
        num_hidden_layers=2,
        hidden_size=32,
        head_dim=8,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        vocab_size=260,
        max_position_embeddings=64,
        **overrides,
    )


def _greedy(model_dir, n=8):
    runner = ModelRunner(model_dir, cache_slots=0, reserved_bytes=0)
    drive = SequenceDriver(runner)
    seq = drive.start(runner.tokenizer.encode("fused or not"))
    logits, out = drive.prefill(seq), []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = drive.decode(seq, out[-1])
    return out, logits


def test_fused_3d_expert_tensors_read_like_per_expert(tmp_path):
    plain = _tiny(tmp_path / "plain")
    fused = _tiny(tmp_path / "fused")
    weights = load_file(fused / "model.safetensors")
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts"
        gate_up, down = [], []
        for e in range(4):
            gate_up.append(
                torch.cat(
                    [
                        weights.pop(f"{p}.{e}.gate_proj.weight"),
                        weights.pop(f"{p}.{e}.up_proj.weight"),
                    ]
                )
            )  # [2F, D]
            down.append(weights.pop(f"{p}.{e}.down_proj.weight"))  # [D, F]
        weights[f"{p}.gate_up_proj"] = torch.stack(gate_up)  # [E, 2F, D]
        weights[f"{p}.down_proj"] = torch.stack(down)  # [E, D, F]
    save_file(weights, str(fused / "model.safetensors"), metadata={"format": "pt"})
    want, want_logits = _greedy(plain)
    got, got_logits = _greedy(fused)
    assert got == want and torch.equal(got_logits, want_logits)


def test_bf16_weights_are_served_in_bf16_and_widened_on_request(tmp_path):
    d = _tiny(tmp_path / "bf16")
    weights = {k: v.to(torch.bfloat16) for k, v in load_file(d / "model.safetensors").items()}
    save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
    runner = ModelRunner(d, cache_slots=0, reserved_bytes=0)  # --dtype auto
    drive = SequenceDriver(runner)
    assert runner.model.embed.dtype == torch.bfloat16
    assert runner.cache.host.blobs.dtype == torch.bfloat16
    assert drive.prefill(drive.start([1, 2, 3])).dtype == torch.float32  # logits stay fp32
    runner = ModelRunner(d, cache_slots=0, reserved_bytes=0, dtype="fp32")
    drive = SequenceDriver(runner)
    assert runner.model.embed.dtype == torch.float32
    assert runner.cache.host.blobs.dtype == torch.float32
    seq = drive.start([1, 2, 3])
    assert drive.prefill(seq).dtype == torch.float32

class _StoredAs:
    """A reader that says what dtype its embedding is stored in (safetensors or GGUF names)."""

    def __init__(self, stored: str):
        self.stored = stored

    def stored_dtype(self, name: str) -> str:
        assert name == "model.embed_tokens.weight"
        return self.stored


@pytest.mark.parametrize(("stored", "served"), [
    ("BF16", torch.bfloat16), ("F32", torch.float32), ("F16", torch.float32),
    ("Q8_0", torch.bfloat16), ("Q4_K", torch.bfloat16)])
def test_dtype_auto_serves_as_stored(stored, served):
    assert resolve_dtype("auto", _StoredAs(stored)) == served
    assert resolve_dtype("fp32", _StoredAs(stored)) == torch.float32
    assert resolve_dtype("bf16", _StoredAs(stored)) == torch.bfloat16


def test_other_dtypes_are_refused_by_name():
    with pytest.raises(ValueError, match="fp16"):
        resolve_dtype("fp16", _StoredAs("F32"))
    with pytest.raises(ValueError, match="float16"):
        resolve_dtype(torch.float16, _StoredAs("F32"))
    assert resolve(SETTINGS, environ={"STRATA_DTYPE": "bf16"})["dtype"] == "bf16"
    with pytest.raises(ConfigError, match="STRATA_DTYPE"):
        resolve(SETTINGS, environ={"STRATA_DTYPE": "fp16"})
