"""gpt-oss as OpenAI releases it: experts in MXFP4 blocks (`*_proj_blocks`, `*_proj_scales`),
held as stored (re-laid once into GGUF's MXFP4 block, bit for bit) and computed on by the
kernels; checked against transformers running the weights its own MXFP4 dequantization
(integrations/mxfp4.py's convert_moe_packed_tensors) gives."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from services.engine.cache.formats import BlockFormat  # noqa: E402
from services.engine.model.blocks import dequantize, mxfp4_from_openai  # noqa: E402
from services.engine.runner import ModelRunner, slot_bytes_of  # noqa: E402
from tests.engine.test_model_families import make_family_checkpoint  # noqa: E402
from tests.engine.test_model_reference import assert_matches_reference  # noqa: E402

FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)


def openai_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows w [..., R, K] -> OpenAI's MXFP4 (blocks uint8 [..., R, K / 32, 16], scales
    [..., R, K / 32]): a power-of-two scale per 32 weights, each weight its nearest FP4 value,
    weight 2j in byte j's low nibble."""
    b = w.reshape(*w.shape[:-1], -1, 32)
    amax = np.abs(b).max(axis=-1)
    e = np.clip(np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), -127, 127).astype(np.int32)
    q = np.abs(b[..., None] / np.exp2(e)[..., None, None] - FP4).argmin(axis=-1)
    q = q.astype(np.uint8)
    return (np.ascontiguousarray(q[..., 0::2] | (q[..., 1::2] << 4)),
            np.ascontiguousarray((e + 127).astype(np.uint8)))


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    """A tiny random gpt_oss (F 32: whole MXFP4 blocks) written as the released checkpoints
    are, and transformers' model on the weights its own dequantization of those blocks gives."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    model_dir, ref = make_family_checkpoint(path, "gpt_oss", seed=4, intermediate_size=32)
    tensors = load_file(model_dir / "model.safetensors")
    for i, layer in enumerate(ref.model.layers):
        experts = layer.mlp.experts
        for name, rows in (("gate_up_proj", experts.gate_up_proj.transpose(1, 2)),
                           ("down_proj", experts.down_proj.transpose(1, 2))):
            blocks, scales = openai_mxfp4(rows.detach().numpy())  # [E, out, in / 32, ...]
            stem = f"model.layers.{i}.mlp.experts.{name}"
            del tensors[stem]
            tensors[f"{stem}_blocks"] = torch.from_numpy(blocks)
            tensors[f"{stem}_scales"] = torch.from_numpy(scales)
            values = convert_moe_packed_tensors(torch.from_numpy(blocks),
                                                torch.from_numpy(scales), dtype=torch.float32)
            getattr(experts, name).data.copy_(values)  # [E, in, out], as the module holds it
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir, ref


def test_the_relayout_keeps_every_weight():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 96)).astype(np.float32)
    blocks, scales = openai_mxfp4(w)
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    want = convert_moe_packed_tensors(torch.from_numpy(blocks)[None],
                                      torch.from_numpy(scales)[None], dtype=torch.float32)
    got = dequantize(torch.from_numpy(mxfp4_from_openai(blocks, scales)), "MXFP4")
    assert torch.equal(got.view(6, 96), want[0].T)


def test_mxfp4_experts_are_held_as_stored_with_their_biases(mxfp4_checkpoint):
    model_dir, _ = mxfp4_checkpoint
    runner = ModelRunner(model_dir, cache_slots=0, reserved_bytes=0, dtype="fp32")
    fmt = runner.cache.format
    assert isinstance(fmt, BlockFormat) and fmt.kernel_types == ("MXFP4",) * 3
    weights = 3 * 64 * 32 // 32 * 17
    assert fmt.bias_at == -(-weights // 16) * 16
    assert fmt.blob_bytes == slot_bytes_of(model_dir) == fmt.bias_at + 4 * (2 * 32 + 64)


@pytest.mark.parametrize("cpu_kernels", ["off", "auto"])
def test_mxfp4_gpt_oss_matches_transformers_on_its_dequantized_weights(mxfp4_checkpoint,
                                                                       cpu_kernels):
    """Torch ops on the format's reference dequantization: transformers' logits within 1e-4.
    The C kernels round activations to 8 bits per block of 32 (as llama.cpp does): within
    3% of the logits' scale, greedy tokens the same on this prompt."""
    model_dir, ref = mxfp4_checkpoint
    if cpu_kernels == "off":
        assert_matches_reference(model_dir, ref, steps=6, cpu_kernels="off")
    else:
        assert_matches_reference(model_dir, ref, steps=6, atol=0.03, cpu_kernels="auto")
