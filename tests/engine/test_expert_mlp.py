"""Experts with gpt-oss's MLP (model/layers/mlp.py's ExpertMlp: the clamped SwiGLU, biases in
the blob): the C kernel strata_moe on every kind of blob equals the format's torch reference,
and a blob's biases sit after its weights without moving them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.engine.cache.formats import BlockFormat, DenseFormat, Fp8Format, QuantFormat
from services.engine.cache.layout import num_splits
from services.engine.model.blocks import round_activations
from services.engine.model.layers.mlp import ExpertMlp

GPT_OSS = ExpertMlp("clamped", alpha=1.702, limit=0.6, bias=True)  # the clamps bite at 0.6
D, Fs, E, K = 256, 128, 5, 2


def blobs_of(fmt, rng: np.random.Generator) -> torch.Tensor:
    """E blobs of `fmt`: random weights (packed floats, or random stored rows / codes), then
    random biases where the format has them."""
    out = torch.zeros(E, fmt.numel, dtype=fmt.dtype)
    for e in range(E):
        if isinstance(fmt, BlockFormat):
            from tests.engine.test_block_kernels import random_rows

            g, u, d = fmt.kernel_types
            rows = np.concatenate([random_rows(g, Fs, D, rng).reshape(-1),
                                   random_rows(u, Fs, D, rng).reshape(-1),
                                   random_rows(d, D, Fs, rng).reshape(-1)])
            out[e, :rows.size] = torch.from_numpy(rows)
        elif isinstance(fmt, Fp8Format):
            codes = rng.integers(0, 256, 3 * D * Fs, dtype=np.uint8)
            codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
            scales = rng.uniform(0.5, 2.0, sum(fmt.scales)).astype(np.float32) * 1e-3
            out[e, :codes.size + 4 * scales.size] = torch.from_numpy(
                np.concatenate([codes, scales.view(np.uint8)]))
        else:
            w = torch.from_numpy(rng.standard_normal((3, Fs, D)).astype(np.float32)) * 0.1
            fmt.pack(w[0], w[1], w[2].T.contiguous(), out[e])
        if (bias := fmt.biases(out[e])) is not None:
            bias.copy_(torch.from_numpy(rng.standard_normal(bias.numel()).astype(np.float32)))
    return out


def formats() -> dict[str, object]:
    return {
        "fp32": DenseFormat(D, Fs, torch.float32, GPT_OSS),
        "bf16": DenseFormat(D, Fs, torch.bfloat16, GPT_OSS),
        "fp32_io": DenseFormat(D, Fs, torch.float32, GPT_OSS, inputs_major=True),
        "bf16_io": DenseFormat(D, Fs, torch.bfloat16, GPT_OSS, inputs_major=True),
        "fp8": Fp8Format(D, Fs, (128, 128), GPT_OSS),
        "mxfp4": BlockFormat(D, Fs, {0: ("MXFP4",) * 3}, mlp=GPT_OSS),
        "q4_k+q8_0": BlockFormat(D, Fs, {0: ("Q4_K", "Q8_0", "Q8_0")}, mlp=GPT_OSS),
    }


def test_biases_follow_the_weights_16_aligned_and_leave_them_in_place():
    for name, fmt in formats().items():
        plain = {"fp32": DenseFormat(D, Fs, torch.float32), "bf16": DenseFormat(
            D, Fs, torch.bfloat16), "fp32_io": DenseFormat(D, Fs, torch.float32,
                                                            inputs_major=True),
            "bf16_io": DenseFormat(D, Fs, torch.bfloat16, inputs_major=True),
            "fp8": Fp8Format(D, Fs, (128, 128)),
            "mxfp4": BlockFormat(D, Fs, {0: ("MXFP4",) * 3}),
            "q4_k+q8_0": BlockFormat(D, Fs, {0: ("Q4_K", "Q8_0", "Q8_0")})}[name]
        assert fmt.bias_at >= plain.blob_bytes and fmt.bias_at % 16 == 0, name
        assert fmt.blob_bytes % 16 == 0 and fmt.blob_bytes >= fmt.bias_at + 4 * (2 * Fs + D)
        assert plain.bias_at == -1 and plain.biases(torch.zeros(plain.numel,
                                                                 dtype=plain.dtype)) is None
    q = QuantFormat(D, Fs, "int8", GPT_OSS)
    assert q.bias_at >= QuantFormat(D, Fs, "int8").blob_bytes


def reference(fmt, blob: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """One expert the way the kernel rounds: fp32 products on the weights widened; block types
    see x and the activation rounded to 8 bits per block (cpu_kernels.c's product_blocks)."""
    if not isinstance(fmt, BlockFormat):
        return fmt.mlp.forward(x, *fmt.weights(blob, torch.float32), fmt.biases(blob))
    gate, up, down = (w.double() for w in fmt.weights(blob, torch.float32))
    t = fmt.kernel_types
    bias = fmt.biases(blob).double()
    g = round_activations(x, t[0]).double() @ gate.T + bias[:Fs]
    u = round_activations(x, t[1]).double() @ up.T + bias[Fs:2 * Fs]
    h = fmt.mlp.activation(g.float(), u.float())
    return (round_activations(h, t[2]).double() @ down.T + bias[2 * Fs:]).float()


@pytest.mark.parametrize("name", list(formats()))
def test_the_c_kernel_computes_the_clamped_swiglu_with_biases_as_the_reference(cpu, name):
    fmt = formats()[name]
    blobs = blobs_of(fmt, np.random.default_rng(7))
    g = torch.Generator().manual_seed(3)
    T = 6
    x = torch.randn(T, D, generator=g)
    top_idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    top_w = torch.rand(T, K, generator=g)
    addr = np.array([b.data_ptr() for b in blobs], dtype=np.int64)
    y = cpu.moe(x, top_idx, top_w, addr, Fs, num_splits(D), weights=fmt.kernel_weights,
                block_types=fmt.kernel_types, fp8_block=fmt.kernel_block, mlp=fmt.mlp,
                bias_at=fmt.bias_at)
    want = torch.zeros(T, D)
    for t in range(T):
        for k in sorted(range(K), key=lambda k: int(top_idx[t, k])):
            want[t] += top_w[t, k] * reference(fmt, blobs[int(top_idx[t, k])], x[t:t + 1])[0]
    scale = float(want.abs().max())
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4 * scale)
    clamped = ExpertMlp("clamped", limit=0.6)  # the same blobs without their biases differ
    y_nobias = cpu.moe(x, top_idx, top_w, addr, Fs, num_splits(D), weights=fmt.kernel_weights,
                       block_types=fmt.kernel_types, fp8_block=fmt.kernel_block, mlp=clamped)
    assert (y_nobias - y).abs().max() > 100 * (1e-4 * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_inputs_major_blob_holds_the_transposed_matrices_and_computes_the_same(dtype):
    """The [in, out] layout packs each matrix transposed, unpacks to the same weights and gives
    the [out, in] layout's torch result."""
    rows, cols = DenseFormat(D, Fs, dtype), DenseFormat(D, Fs, dtype, inputs_major=True)
    g = torch.Generator().manual_seed(5)
    gate, up, down = (torch.randn(Fs, D, generator=g), torch.randn(Fs, D, generator=g),
                      torch.randn(D, Fs, generator=g))
    a, b = torch.zeros(rows.numel, dtype=dtype), torch.zeros(cols.numel, dtype=dtype)
    rows.pack(gate, up, down, a)
    cols.pack(gate, up, down, b)
    assert torch.equal(b[:D * Fs].view(D, Fs), gate.T.to(dtype))
    assert torch.equal(b[2 * D * Fs:3 * D * Fs].view(Fs, D), down.T.to(dtype))
    for wa, wb in zip(rows.weights(a, torch.float32), cols.weights(b, torch.float32),
                      strict=True):
        assert torch.equal(wa, wb)
    x = torch.randn(3, D, generator=g)
    want = rows.forward(x, a)  # torch's products in another order: equal to rounding
    torch.testing.assert_close(cols.forward(x, b), want, rtol=1e-4,
                               atol=1e-4 * float(want.abs().max()))
    assert cols.kernel_weights == rows.kernel_weights + "_io"
