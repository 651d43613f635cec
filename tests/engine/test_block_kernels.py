"""GGUF block types computed as stored (#19): each type's dequantization equals gguf-py's
reference bit for bit, and the CPU kernels' integer products (activations rounded to 8 bits)
equal the reference product on the same rounded activations to fp32 rounding, whatever the
batch, the tile or where the weights lie."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

from services.engine.cache.formats import BlockFormat  # noqa: E402
from services.engine.cache.layout import num_splits  # noqa: E402
from services.engine.model.blocks import (  # noqa: E402
    BLOCK_TYPES,
    BlockMatrix,
    block_type,
    dequantize,
    round_activations,
)

TYPES = list(BLOCK_TYPES)
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2),
              "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,),
              "MXFP4": ()}  # byte offsets of each block's fp16 scales


def random_rows(name: str, rows: int, in_features: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row bytes]: random quants and sub-block scales (every bit pattern is a
    valid block), fp16 scales of either sign around 1e-3."""
    t = block_type(name)
    n = rows * in_features // t.weights
    blocks = rng.integers(0, 256, size=(n, t.bytes), dtype=np.uint8)
    for at in F16_FIELDS[name]:
        scale = (rng.uniform(0.2, 1.0, n) * rng.choice([-1, 1], n) * 1e-3).astype(np.float16)
        blocks[:, at:at + 2] = scale.view(np.uint8).reshape(n, 2)
    if name == "MXFP4":  # an E8M0 exponent byte: 2^(e - 128) around 2^-8
        blocks[:, 0] = rng.integers(116, 124, n)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("name", TYPES)
def test_dequantization_is_gguf_py_s_bit_for_bit(name):
    rows = random_rows(name, 8, 512, np.random.default_rng(1))
    want = gguf_dequantize(rows, getattr(Q, name))  # [8, 512]
    got = dequantize(torch.from_numpy(rows), name).view(8, 512)
    assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(want)))


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_rows_gives_the_reference_rows(cpu, name):
    """The C embedding lookup against dequantize(): the same values to fp32 rounding (the
    K-quants' group terms are applied in another order), rows picked in any order, repeats."""
    rows = random_rows(name, 12, 512, np.random.default_rng(2))
    w = BlockMatrix(torch.from_numpy(rows.reshape(-1)).contiguous(), 512, ((name, 12),))
    ids = torch.tensor([[7, 0, 11], [7, 3, 3]])
    got = cpu.dequantize_rows(w, ids)
    want = w.rows(ids)
    assert got.shape == (2, 3, 512)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))
    with pytest.raises(IndexError):
        cpu.dequantize_rows(w, torch.tensor([12]))


def test_rounded_activations_are_8_bit_per_block():
    x = torch.randn(3, 512)
    for name, bs in (("Q8_0", 32), ("Q4_K", 256)):
        r = round_activations(x, name).view(-1, bs)
        d = x.view(-1, bs).abs().amax(1, keepdim=True) / 127
        q = r / d
        assert torch.allclose(q, q.round(), atol=1e-3) and q.abs().max() <= 127.001
        assert ((r - x.view(-1, bs)).abs() <= d / 2 * 1.001).all()


def reference(x: torch.Tensor, w: torch.Tensor, name: str) -> torch.Tensor:
    """The product on rounded activations, in float64."""
    return (round_activations(x, name).double() @ w.double().T).float()


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("T", [1, 4, 7])
def test_linear_blocks_computes_the_reference_product(cpu, name, T):
    """strata_linear_blocks over rows of one type equals the reference to fp32 rounding; a row
    alone gives the same bits as in any batch."""
    rng = np.random.default_rng(T)
    K, N = 512, 200  # N: not a multiple of the 64-row work unit
    rows = random_rows(name, N, K, rng)
    m = BlockMatrix(torch.from_numpy(rows.reshape(-1)), K, ((name, N),))
    w = m.dequantize()
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(T))
    got = cpu.linear_blocks(x, m)
    want = reference(x, w, name)
    scale = want.abs().max()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(scale))
    alone = torch.cat([cpu.linear_blocks(x[t:t + 1].clone(), m) for t in range(T)])
    assert torch.equal(alone, got)
    # against the unrounded activations: the stated tolerance of the 8-bit rounding
    exact = (x.double() @ w.double().T).float()
    assert (got - exact).norm() / exact.norm() < 0.01


def test_linear_blocks_with_segments_of_different_types(cpu):
    """q | k | v in their own types (Q4_K_M keeps v in Q6_K, a Q8_0 piece for a 32-block
    type) in one call: each segment's rows as if computed alone."""
    rng = np.random.default_rng(3)
    K = 512
    segs = (("Q4_K", 96), ("Q6_K", 32), ("Q8_0", 70))
    parts = [random_rows(t, n, K, rng) for t, n in segs]
    m = BlockMatrix(torch.from_numpy(np.concatenate([p.reshape(-1) for p in parts])), K, segs)
    x = torch.randn(3, K)
    got = cpu.linear_blocks(x, m)
    assert got.shape == (3, m.out_features)
    at = 0
    for (t, n), p in zip(segs, parts, strict=True):
        alone = cpu.linear_blocks(x, BlockMatrix(torch.from_numpy(p.reshape(-1)), K, ((t, n),)))
        assert torch.equal(got[:, at:at + n], alone)
        at += n
    w = m.dequantize()
    torch.testing.assert_close(got[:, :96], reference(x, w[:96], "Q4_K"), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q8_0", "Q8_0"),
                                   ("Q2_K", "Q3_K", "Q5_K"), ("Q4_0", "Q4_K", "Q8_0"),
                                   ("IQ4_XS", "IQ4_NL", "MXFP4")])
@pytest.mark.parametrize("T", [1, 5])
def test_moe_kernel_reads_block_experts_as_the_reference_computes(cpu, types, T):
    """strata_moe on blobs of (gate, up, down) types equals the reference — each expert's
    products on the kernel's rounded inputs (x for gate/up, silu(gate) * up for down) — to
    fp32 rounding; a row alone, or its blobs at another address, give the same bits; and the
    reference on unrounded inputs is within the stated 8-bit tolerance."""
    rng = np.random.default_rng(T)
    D, Fs, E, K = 512, 256, 6, 2
    fmt = BlockFormat(D, Fs, {0: types})
    blobs = torch.from_numpy(np.stack([np.concatenate([
        random_rows(types[0], Fs, D, rng).reshape(-1), random_rows(types[1], Fs, D, rng).reshape(-1),
        random_rows(types[2], D, Fs, rng).reshape(-1)]) for _ in range(E)]))
    assert blobs.shape[1] == fmt.blob_bytes
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, D, generator=g) * 10
    top_idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    top_w = torch.rand(T, K, generator=g)

    def run(blobs, x, top_idx, top_w):
        addr = np.array([b.data_ptr() for b in blobs], dtype=np.int64)
        return cpu.moe(x, top_idx, top_w, addr, Fs, num_splits(D), weights="blocks",
                       block_types=types)

    y = run(blobs, x, top_idx, top_w)
    want, exact = torch.zeros(T, D, dtype=torch.float64), torch.zeros(T, D)
    for t in range(T):
        for k in sorted(range(K), key=lambda k: int(top_idx[t, k])):
            gate, up, down = (w.double() for w in fmt.weights(blobs[int(top_idx[t, k])],
                                                                torch.float32))
            xg = round_activations(x[t:t + 1], types[0]).double()
            xu = round_activations(x[t:t + 1], types[1]).double()
            h = (torch.nn.functional.silu((xg @ gate.T).float())
                 * (xu @ up.T).float())
            want[t] += top_w[t, k] * (round_activations(h, types[2]).double() @ down.T)[0]
            exact[t] += top_w[t, k] * fmt.forward(x[t:t + 1], blobs[int(top_idx[t, k])])[0]
    want = want.float()
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    alone = torch.cat([run(blobs, x[t:t + 1].clone(), top_idx[t:t + 1].clone(),
                           top_w[t:t + 1].clone()) for t in range(T)])
    assert torch.equal(y, alone)
    assert torch.equal(run(blobs.clone(), x, top_idx, top_w), y)
    # h = silu(gate) * up is heavy-tailed: a 256-block's max sets its step (~3% of the norm)
    assert (y - exact).norm() / exact.norm() < 0.05
