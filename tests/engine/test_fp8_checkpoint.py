"""FP8 checkpoints with block scales (the DeepSeek-V3 / Kimi-K2 / MiniMax-M2 / Qwen3-*-FP8
layout: an float8_e4m3fn `weight` and an fp32 `weight_scale_inv` per weight_block_size block)
are read as their values, weight times its block's scale — the same numbers as the checkpoint
dequantized — never as the bare FP8 codes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from services.engine.model.blocks import Fp8Matrix
from services.engine.model.checkpoint import CheckpointError, load_model_config
from services.engine.runner import ModelRunner
from tests.engine.conftest import make_hf_checkpoint
from tests.engine.test_runner import greedy, greedy_by_cache_size

BLOCK = (32, 16)  # small blocks, so the tiny matrices hold several, including ragged edges
PROMPT = "def fp8(x):"


def fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 codes, block scales) of a [..., out, in] weight: per BLOCK block, amax / 448."""
    *lead, rows, cols = w.shape
    bo, bi = BLOCK
    ro, ri = -(-rows // bo), -(-cols // bi)
    padded = torch.zeros(*lead, ro * bo, ri * bi)
    padded[..., :rows, :cols] = w
    blocks = padded.reshape(*lead, ro, bo, ri, bi)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / 448.0  # [..., ro, ri]
    codes = (blocks / scale[..., :, None, :, None]).reshape(*lead, ro * bo, ri * bi)
    return codes[..., :rows, :cols].to(torch.float8_e4m3fn).contiguous(), scale.float()


def dequantized(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, cols = codes.shape[-2:]
    full = scale.repeat_interleave(BLOCK[0], -2)[..., :rows, :].repeat_interleave(
        BLOCK[1], -1)[..., :cols]
    return codes.float() * full


@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory):
    """(an FP8 checkpoint, the same values as an fp32 checkpoint): every projection and expert
    matrix in FP8 with block scales; embeddings, lm_head, router and norms as they are."""
    root = tmp_path_factory.mktemp("fp8")
    src, _ = make_hf_checkpoint(root / "src", seed=11)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    fp8, ref = {}, {}
    for name, w in tensors.items():
        quantize = (w.dim() >= 2 and name.endswith(("proj.weight", "gate_up_proj", "down_proj"))
                    and "mlp.gate." not in name)
        if not quantize:
            fp8[name], ref[name] = w, w.float()
            continue
        codes, scale = fp8_blocks(w.float())
        fp8[name], fp8[f"{name}_scale_inv"] = codes, scale
        ref[name] = dequantized(codes, scale)
    out = {}
    for kind, tensors_of in (("fp8", fp8), ("ref", ref)):
        d = root / kind
        d.mkdir()
        for f in src.iterdir():
            if f.suffix != ".safetensors" and f.is_file():
                (d / f.name).write_bytes(f.read_bytes())
        save_file(tensors_of, str(d / "model.safetensors"))
        for index in d.glob("*.index.json"):
            index.unlink()
        out[kind] = d
    config = json.loads((out["fp8"] / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": list(BLOCK)}
    (out["fp8"] / "config.json").write_text(json.dumps(config))
    assert any(t.dtype == torch.float8_e4m3fn for t in fp8.values())
    return out["fp8"], out["ref"]


def test_fp8_experts_are_held_as_stored_and_compute_their_values(fp8_pair):
    """The routed experts stay FP8 (one byte a weight plus the block scales) in the host store
    and the slots; the model computes what the checkpoint of the dequantized values computes,
    to fp32 rounding (the kernel converts the codes exactly and applies each block's scale
    once per block), with the same greedy tokens; greedy output is identical across cache
    sizes."""
    from services.engine.cache.formats import Fp8Format

    fp8, ref = fp8_pair
    a = ModelRunner(fp8, cache_slots=10**6, reserved_bytes=0, dtype="fp32")
    assert isinstance(a.cache.format, Fp8Format) and a.cache.format.kernel_block == BLOCK
    assert a.cache.cpu_kernels  # strata_moe reads the codes
    D, F = a.config.hidden_size, a.config.moe_intermediate_size
    assert a.slot_bytes == 3 * D * F + 4 * (2 * -(-F // BLOCK[0]) * -(-D // BLOCK[1])
                                            + -(-D // BLOCK[0]) * -(-F // BLOCK[1]))
    attn = a.model.layers[1].attn  # q | k | v and o stay FP8 too (whole blocks of rows)
    assert isinstance(attn.qkv, Fp8Matrix) and isinstance(attn.o, Fp8Matrix)
    assert attn.qkv.codes.dtype == torch.uint8 and attn.qkv.block == BLOCK
    b = ModelRunner(ref, cache_slots=10**6, reserved_bytes=0, dtype="fp32")
    _, tokens_a, logits_a = greedy(a, PROMPT, n=8)
    _, tokens_b, logits_b = greedy(b, PROMPT, n=8)
    assert tokens_a == tokens_b
    torch.testing.assert_close(logits_a, logits_b, rtol=1e-4, atol=1e-4)
    outputs = greedy_by_cache_size(fp8, (0, 10), PROMPT)
    assert outputs[0][0] == outputs[1][0] and torch.equal(outputs[0][1], outputs[1][1])


@pytest.mark.parametrize("T", [1, 5])
def test_the_c_kernel_reads_fp8_blobs_as_the_reference_computes(cpu, T):
    """strata_moe on Fp8Format blobs (random codes, subnormal ones included, and block
    scales) equals the format's torch reference to fp32 rounding; a row alone gives the same
    bits as in a batch."""
    from services.engine.cache.formats import Fp8Format
    from services.engine.cache.layout import num_splits

    D, F, E, K = 96, 80, 5, 2
    fmt = Fp8Format(D, F, BLOCK)
    g = torch.Generator().manual_seed(T)
    blobs = []
    for _ in range(E):
        codes = torch.randint(0, 256, (3 * D * F,), generator=g, dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x3C  # no NaN codes (e4m3 has no infinities)
        scales = torch.rand(sum(fmt.scales), generator=g) * 1e-2 + 1e-3
        blobs.append(torch.cat([codes, scales.view(torch.uint8)]))
    blobs = torch.stack(blobs)
    assert blobs.shape[1] == fmt.blob_bytes
    x = torch.randn(T, D, generator=g)
    top_idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    top_w = torch.rand(T, K, generator=g)

    def run(x, top_idx, top_w):
        addr = np.array([b.data_ptr() for b in blobs], dtype=np.int64)
        return cpu.moe(x, top_idx, top_w, addr, F, num_splits(D), weights="fp8",
                       fp8_block=BLOCK)

    y = run(x, top_idx, top_w)
    want = torch.zeros(T, D)
    for t in range(T):
        for k in sorted(range(K), key=lambda k: int(top_idx[t, k])):
            want[t] += top_w[t, k] * fmt.forward(x[t:t + 1], blobs[int(top_idx[t, k])])[0]
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    alone = torch.cat([run(x[t:t + 1].clone(), top_idx[t:t + 1].clone(),
                           top_w[t:t + 1].clone()) for t in range(T)])
    assert torch.equal(alone, y)


def test_fused_fp8_expert_stacks_are_read_as_their_values(fp8_pair, tmp_path):
    """The same experts as fused stacks (experts.gate_up_proj [E, 2F, D], experts.down_proj
    [E, D, F], each with its [E, ...] block scales): read slab by slab as code times scale,
    the dequantized checkpoint's tokens and logits (to fp32 rounding: the attention runs on its
    FP8 codes, the reference on their values)."""
    fp8, ref = fp8_pair
    config = load_model_config(Path(fp8))
    E, F = config.num_experts, config.moe_intermediate_size
    assert F % BLOCK[0] == 0  # gate's and up's scale rows stack as their rows do
    tensors = load_file(str(Path(fp8) / "model.safetensors"))
    fused = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in config.moe_layers:
        p = f"model.layers.{layer}.mlp.experts"

        def stack(proj: str, suffix: str = "", p: str = p) -> torch.Tensor:
            return torch.stack([tensors[f"{p}.{e}.{proj}.weight{suffix}"] for e in range(E)])

        for suffix in ("", "_scale_inv"):
            fused[f"{p}.gate_up_proj{suffix}"] = torch.cat(
                [stack("gate_proj", suffix), stack("up_proj", suffix)], dim=1).contiguous()
            fused[f"{p}.down_proj{suffix}"] = stack("down_proj", suffix).contiguous()
    d = tmp_path / "fused"
    d.mkdir()
    for f in Path(fp8).iterdir():
        if f.suffix != ".safetensors":
            (d / f.name).write_bytes(f.read_bytes())
    save_file(fused, str(d / "model.safetensors"))
    a = ModelRunner(d, cache_slots=10**6, reserved_bytes=0, dtype="fp32")
    b = ModelRunner(ref, cache_slots=10**6, reserved_bytes=0, dtype="fp32")
    _, tokens_a, logits_a = greedy(a, PROMPT, n=8)
    _, tokens_b, logits_b = greedy(b, PROMPT, n=8)
    assert tokens_a == tokens_b
    torch.testing.assert_close(logits_a, logits_b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("T", [1, 6])
def test_fp8_matrices_compute_their_dequantized_product(cpu, T):
    """strata_linear_fp8 (the CPU backend's product on an Fp8Matrix: q | k | v, o, MLA's q_b)
    against x @ dequantize().T in float64: 70 rows of 104 inputs in 32 x 16 blocks (ragged in
    both), subnormal codes included, strided x; to fp32 rounding."""
    g = torch.Generator().manual_seed(T)
    codes, scale = fp8_blocks(torch.randn(70, 104, generator=g))
    codes = codes.view(torch.uint8)
    codes[::7, ::5] = torch.randint(1, 8, codes[::7, ::5].shape, generator=g,
                                    dtype=torch.uint8)  # subnormal codes
    w = Fp8Matrix(codes.contiguous(), scale, BLOCK)
    x = torch.randn(T, 208, generator=g)[:, :104]
    want = x.double() @ w.dequantize(torch.float64).T
    got = cpu.linear_fp8(x, w)
    assert got.shape == (T, 70)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_every_fp8_code_converts_exactly(cpu):
    """Row c of the matrix holds code c once (then zeros): y = x @ W^T with x = (1, 0, ...)
    gives each code's value, which must be torch's float8_e4m3fn value bit for bit: normal
    and subnormal codes of both signs, and zero (0x7f / 0xff are NaN there: left out)."""
    codes = torch.zeros(256, 16, dtype=torch.uint8)
    codes[:, 0] = torch.arange(256, dtype=torch.uint8)
    keep = torch.tensor([c not in (0x7F, 0xFF) for c in range(256)])
    w = Fp8Matrix(codes, torch.ones(8, 1), BLOCK)
    x = torch.zeros(1, 16)
    x[0, 0] = 1.0
    got = cpu.linear_fp8(x, w)[0]
    want = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    assert torch.equal(got[keep], want[keep])


def test_fp8_without_its_scales_is_refused(fp8_pair, tmp_path):
    fp8, _ = fp8_pair
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in Path(fp8).iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(broken / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if not k.endswith("_scale_inv")},
              str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError, match="without .*weight_scale_inv"):
        ModelRunner(broken, cache_slots=0, reserved_bytes=0)
