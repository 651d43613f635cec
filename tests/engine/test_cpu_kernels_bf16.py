"""bf16 weights in the CPU kernels (services/engine/kernels/cpu_kernels.c): a bf16 weight is
widened to fp32 exactly right after it is loaded and then runs the fp32 kernel's FMA sequence,
so every product on bf16 weights w is bit-identical to the fp32 kernel on w.float(); and a row's
result still never depends on the other rows of the call or on the weight's address."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.engine import kernels
from services.engine.cache.layout import ExpertLayout

ROWS = [1, 2, 3, 4, 5, 8, 9]


def rows_alone(fn, *row_args):
    """fn applied to each row on its own (a call with one row), stacked."""
    T = row_args[0].shape[0]
    return torch.cat([fn(*(a[t:t + 1].clone() for a in row_args)) for t in range(T)])


def at_odd_address(w: torch.Tensor) -> torch.Tensor:
    """The same values at another address, one element (2 bytes for bf16) off alignment."""
    buf = torch.empty(w.numel() + 1, dtype=w.dtype)
    moved = buf[1:].view(w.shape)
    moved.copy_(w)
    return moved


def test_weight_types(cpu):
    assert cpu.weight_type(torch.float32) == 0 and cpu.weight_type(torch.bfloat16) == 1
    with pytest.raises(TypeError, match="fp32 or bf16"):
        cpu.weight_type(torch.float16)
    with pytest.raises(AssertionError):  # activations stay fp32
        cpu.linear(torch.ones(1, 4, dtype=torch.bfloat16), torch.ones(2, 4))


# Output rows: fewer than a unit each, a ragged split into units; inputs K not a multiple of a
# vector (a row's tail).
@pytest.mark.parametrize("n", [5, 37, 100, 256, 333, 600])
@pytest.mark.parametrize("T", ROWS)
def test_linear_bf16_equals_fp32_on_the_widened_weight(cpu, T, n):
    g = torch.Generator().manual_seed(T * 1000 + n)
    K = 72
    w = torch.randn(2 * n, K, generator=g).bfloat16()  # [N, K] bf16
    x = torch.randn(T, K, generator=g)
    y = cpu.linear(x, w)
    assert y.dtype == torch.float32 and y.shape == (T, 2 * n)
    assert torch.equal(y, cpu.linear(x, w.float()))
    torch.testing.assert_close(y, x @ w.float().t(), rtol=1e-5, atol=1e-5)
    assert torch.equal(y, rows_alone(lambda r: cpu.linear(r, w), x))
    assert torch.equal(cpu.linear(x, at_odd_address(w)), y)
    strided = torch.randn(T, 2 * K, generator=g)[:, :K]
    assert torch.equal(cpu.linear(strided, w), cpu.linear(strided.contiguous(), w.float()))


@pytest.mark.parametrize("T", [1, 5])
def test_matmul_bf16_equals_fp32_on_the_widened_weight(cpu, T):
    g = torch.Generator().manual_seed(T)
    w_t = torch.randn(40, 77, generator=g).bfloat16()  # [K, N] pre-transposed (routers, gates)
    x = torch.randn(T, 40, generator=g)
    y = cpu.matmul(x, w_t)
    assert torch.equal(y, cpu.matmul(x, w_t.float()))
    torch.testing.assert_close(y, x @ w_t.float(), rtol=1e-5, atol=1e-5)


def moe_case(T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    D, Fs, E, K = 136, 72, 12, 4  # D/S = 68 and F: not multiples of 16
    layout = ExpertLayout(D, Fs)
    blobs = (torch.randn(E, layout.numel, generator=g) * 0.1).bfloat16()
    x = torch.randn(T, D, generator=g)
    top_idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    top_w = torch.rand(T, K, generator=g)
    return layout, blobs, x, top_idx, top_w


def addresses(blobs: torch.Tensor) -> np.ndarray:
    return np.array([b.data_ptr() for b in blobs], dtype=np.int64)


@pytest.mark.parametrize("T", ROWS)
def test_moe_bf16_equals_fp32_on_the_widened_blobs(cpu, T):
    layout, blobs, x, top_idx, top_w = moe_case(T, T)
    Fs = layout.ffn_size
    y = cpu.moe(x, top_idx, top_w, addresses(blobs), Fs, 2, weights="bf16")
    wide = blobs.float()
    assert torch.equal(y, cpu.moe(x, top_idx, top_w, addresses(wide), Fs, 2))
    want = torch.zeros_like(x)  # the per-expert torch path on the widened blobs
    for t in range(T):
        for k in sorted(range(top_idx.shape[1]), key=lambda k: int(top_idx[t, k])):
            want[t] += top_w[t, k] * layout.forward(x[t:t + 1], wide[int(top_idx[t, k])])[0]
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    alone = rows_alone(lambda *a: cpu.moe(*a, addresses(blobs), Fs, 2, weights="bf16"),
                       x, top_idx, top_w)
    assert torch.equal(y, alone)
    # The same bytes at other addresses (a slot instead of the host store; then only 2-byte
    # aligned): the same result.
    moved = blobs.clone()
    assert torch.equal(cpu.moe(x, top_idx, top_w, addresses(moved), Fs, 2, weights="bf16"), y)
    odd = [at_odd_address(b) for b in blobs]
    odd_addr = np.array([b.data_ptr() for b in odd], dtype=np.int64)
    assert torch.equal(cpu.moe(x, top_idx, top_w, odd_addr, Fs, 2, weights="bf16"), y)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("T", ROWS)
def test_router_bf16_equals_fp32_on_the_widened_weight(cpu, T, renormalize):
    g = torch.Generator().manual_seed(10 + T)
    D, E, K = 72, 40, 6  # E: not a multiple of 16
    x, router_t = torch.randn(T, D, generator=g), torch.randn(D, E, generator=g).bfloat16()
    top_idx, top_w, counts = cpu.router(x, router_t, K, renormalize)
    want_idx, want_w, want_counts = cpu.router(x, router_t.float(), K, renormalize)
    assert torch.equal(top_idx, want_idx) and torch.equal(top_w, want_w)
    assert counts.tolist() == want_counts.tolist()
    probs = torch.softmax(x @ router_t.float(), dim=-1)
    ref_w, ref_idx = torch.topk(probs, K, dim=-1)
    assert torch.equal(top_idx, ref_idx)
    for t in range(T):  # row t alone
        idx1, w1, _ = cpu.router(x[t:t + 1].clone(), router_t, K, renormalize)
        assert torch.equal(idx1[0], top_idx[t]) and torch.equal(w1[0], top_w[t])


class Layer:
    """A random decoder layer for strata_decode_layer, its weights in `dtype`, its KV pools
    its own (so two runs can be compared)."""

    T_MAX, D, H, G, Hd, P, E, K, BLOCKS, N_MAX = 9, 72, 4, 2, 16, 4, 20, 4, 32, 12

    def __init__(self, seed: int, dtype: torch.dtype):
        g = torch.Generator().manual_seed(seed)
        D, H, G, Hd = self.D, self.H, self.G, self.Hd
        nqkv = (H + 2 * G) * Hd
        self.in_norm, self.post_norm = torch.rand(D, generator=g), torch.rand(D, generator=g)
        self.q_norm, self.k_norm = torch.rand(Hd, generator=g), torch.rand(Hd, generator=g)
        self.wqkv = (torch.randn(nqkv, D, generator=g) * 0.2).to(dtype)  # q | k | v rows
        self.wo = (torch.randn(D, H * Hd, generator=g) * 0.2).to(dtype)
        self.router = (torch.randn(D, self.E, generator=g)).to(dtype)
        self.k_pool = torch.randn(self.BLOCKS, self.P, G, Hd, generator=g)
        self.v_pool = torch.randn(self.BLOCKS, self.P, G, Hd, generator=g)
        inv = 1.0 / 10000 ** (torch.arange(0, Hd, 2).float() / Hd)
        freqs = torch.outer(torch.arange(64).float(), inv)
        self.cos = torch.cat([freqs, freqs], -1).cos().contiguous()
        self.sin = torch.cat([freqs, freqs], -1).sin().contiguous()

    def widened(self) -> Layer:
        other = object.__new__(Layer)
        other.__dict__.update({k: v.clone() for k, v in self.__dict__.items()})
        for name in ("wqkv", "wo", "router"):
            setattr(other, name, getattr(self, name).float())
        return other

    def struct(self, wtype: int | None) -> kernels.DecodeLayer:
        args = [self.in_norm.data_ptr(), self.post_norm.data_ptr(), self.wqkv.data_ptr(),
                self.q_norm.data_ptr(), self.k_norm.data_ptr(), self.wo.data_ptr(),
                self.k_pool.data_ptr(), self.v_pool.data_ptr(), self.router.data_ptr()]
        return kernels.DecodeLayer(*args) if wtype is None else kernels.DecodeLayer(*args, wtype)


def decode_layer(cpu, layer: Layer, wtype: int | None, x: torch.Tensor, add: torch.Tensor,
                 positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                 lengths: torch.Tensor) -> dict[str, torch.Tensor]:
    """One strata_decode_layer call on copies of x; every output it writes."""
    L = layer
    T, D = x.shape
    x = x.clone()
    nqkv = (L.H + 2 * L.G) * L.Hd
    max_length = int(lengths.max())
    h, qkv = torch.empty(T, D), torch.empty(T, nqkv)
    attn, o = torch.empty(T, L.H * L.Hd), torch.empty(T, D)
    scores = torch.empty(max(T * L.H * max_length, T * L.E))
    top_idx, top_w = torch.empty(T, L.K, dtype=torch.int64), torch.empty(T, L.K)
    counts = np.empty(L.E, dtype=np.int64)
    step = kernels.DecodeStep(
        T, D, L.H, L.G, L.Hd, L.P, L.E, L.K, 1, tables.stride(0), max_length, 1e-6,
        L.Hd**-0.5, L.cos.data_ptr(), L.sin.data_ptr(), positions.data_ptr(), slots.data_ptr(),
        tables.data_ptr(), lengths.data_ptr(), x.data_ptr(), add.data_ptr(), h.data_ptr(),
        qkv.data_ptr(), attn.data_ptr(), o.data_ptr(), scores.data_ptr(), top_idx.data_ptr(),
        top_w.data_ptr(), counts.ctypes.data)
    cpu.decode_layer(L.struct(wtype), step)
    return {"x": x, "h": h, "qkv": qkv, "attn": attn, "top_idx": top_idx, "top_w": top_w,
            "counts": torch.from_numpy(counts)}


def decode_rows(T: int, seed: int):
    """T decode rows of distinct sequences: positions, KV slots, block tables, lengths."""
    g = torch.Generator().manual_seed(seed)
    L = Layer
    lengths = torch.randint(1, L.N_MAX + 1, (T,), generator=g)
    nb = (L.N_MAX + L.P - 1) // L.P
    perm = torch.randperm(L.BLOCKS, generator=g)[:T * nb]
    tables = perm.view(T, nb).contiguous()
    positions = lengths - 1
    slots = tables[torch.arange(T), positions // L.P] * L.P + positions % L.P
    x = torch.randn(T, L.D, generator=g)
    add = torch.randn(T, L.D, generator=g) * 0.1
    return x, add, positions.contiguous(), slots.contiguous(), tables, lengths.contiguous()


@pytest.mark.parametrize("T", ROWS)
def test_decode_layer_bf16_equals_fp32_on_the_widened_weights(cpu, T):
    bf_layer = Layer(T, torch.bfloat16)
    wide = bf_layer.widened()
    rows = decode_rows(T, 100 + T)
    got = decode_layer(cpu, bf_layer, 1, *rows)
    want = decode_layer(cpu, wide, 0, *rows)
    for name in got:
        assert torch.equal(got[name], want[name]), name
    assert torch.equal(bf_layer.k_pool, wide.k_pool) and torch.equal(bf_layer.v_pool, wide.v_pool)
    # Omitting wtype (existing callers) means fp32.
    default = decode_layer(cpu, wide.widened(), None, *rows)
    assert all(torch.equal(default[name], want[name]) for name in want)
    # Each row alone (a fresh copy of the layer's pools each time) gives its row of the batch.
    for t in range(T):
        alone = decode_layer(cpu, Layer(T, torch.bfloat16), 1,
                             *(r[t:t + 1].clone() for r in rows))
        for name in ("x", "h", "qkv", "attn", "top_idx", "top_w"):
            assert torch.equal(alone[name][0], got[name][t]), (t, name)
