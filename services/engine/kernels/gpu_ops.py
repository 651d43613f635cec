"""The attention half of a layer on a CUDA device, in Triton: the same calls as the CPU kernels
(services.engine.kernels.CpuKernels), so the model picks one or the other by device.

Shape legend: T tokens, R rows, D hidden, H query heads, G KV heads, Hd head dim, B blocks in
the pool, P positions per block, nb block-table columns, N rope table rows.

    rms_norm(x [R, D], weight [D], eps) -> [R, D]           one kernel per call
    qk_norm_rope(qkv [T, (H+2G)*Hd], H, G, Hd, q_norm, k_norm, eps, cos, sin [N, Hd],
                 positions [T])                             in place: per-head RMSNorm + RoPE
    decode_attention(q [T, H, Hd], k, v [B, P, G, Hd] (one layer's pool),
                     block_ids [T, nb], lengths [T], scale, sinks [H], window) -> [T, H, Hd]

Each replaces a chain of small torch ops (six for a norm, a dozen for the q/k norms and RoPE):
fewer kernels per decode step, which is what a small-batch GPU step is made of. fp32 math.

decode_attention:
One program per (token, KV head) reads that head's K/V block by block (only the blocks the
sequence has: the loop runs to ceil(length / P), so a block table may be wider than needed) and
keeps an online softmax for the H/G query heads that share it (GQA: query head h reads KV head
h // (H/G), as HF's repeat_kv). fp32 arithmetic, fixed order; every shape it sees is static, so
a decode step that uses it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, ids_ptr, len_ptr, out_ptr, sinks_ptr, scale,
                             ids_stride, window, H: tl.constexpr, G: tl.constexpr,
                             HD: tl.constexpr, P: tl.constexpr, QH: tl.constexpr,
                             QH_PAD: tl.constexpr, HD_PAD: tl.constexpr, P_PAD: tl.constexpr,
                             SINKS: tl.constexpr):
    t = tl.program_id(0)
    g = tl.program_id(1)
    n = tl.load(len_ptr + t)
    qh = tl.arange(0, QH_PAD)
    hd = tl.arange(0, HD_PAD)
    p = tl.arange(0, P_PAD)
    q_ok = (qh[:, None] < QH) & (hd[None, :] < HD)
    q = tl.load(q_ptr + t * H * HD + (g * QH + qh)[:, None] * HD + hd[None, :], mask=q_ok,
                other=0.0).to(tl.float32)  # [QH_PAD, HD_PAD]
    if SINKS:  # the sink's logit starts the softmax: weight exp(0) = 1, no value
        m_i = tl.load(sinks_ptr + g * QH + qh, mask=qh < QH, other=0.0).to(tl.float32)
        l_i = tl.full((QH_PAD,), 1.0, dtype=tl.float32)
    else:
        m_i = tl.full((QH_PAD,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((QH_PAD,), dtype=tl.float32)
    acc = tl.zeros((QH_PAD, HD_PAD), dtype=tl.float32)
    first = tl.where(window > 0, tl.maximum(n - window, 0), 0)  # a sliding window's start
    for b in range(first // P, tl.cdiv(n, P)):
        block = tl.load(ids_ptr + t * ids_stride + b)
        pos_ok = (p < P) & (b * P + p < n) & (b * P + p >= first)  # [P_PAD]
        kv_off = ((block * P + p)[:, None] * G + g) * HD + hd[None, :]  # [P_PAD, HD_PAD]
        kv_ok = pos_ok[:, None] & (hd[None, :] < HD)
        k = tl.load(k_ptr + kv_off, mask=kv_ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + kv_off, mask=kv_ok, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [QH_PAD, P_PAD]
        s = tl.where(pos_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every block read has a position
        alpha = tl.exp(m_i - m_new)
        w = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(w, axis=1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + t * H * HD + (g * QH + qh)[:, None] * HD + hd[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_ok)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_ids: torch.Tensor,
                     lengths: torch.Tensor, scale: float, sinks: torch.Tensor | None = None,
                     window: int = 0) -> torch.Tensor:
    """q [T, H, Hd]; k, v [B, P, G, Hd]; block_ids [T, nb]; lengths [T] (>= 1) -> [T, H, Hd].
    sinks [H]: a logit per head in the softmax with no value; window > 0: each row's last
    `window` positions only."""
    T, H, Hd = q.shape
    _, P, G, _ = k.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    _decode_attention_kernel[(T, G)](
        q, k, v, block_ids, lengths, out, q if sinks is None else sinks.float().contiguous(),
        scale, block_ids.stride(0), window, H=H, G=G, HD=Hd, P=P, QH=H // G,
        QH_PAD=triton.next_power_of_2(H // G), HD_PAD=triton.next_power_of_2(Hd),
        P_PAD=triton.next_power_of_2(P), SINKS=sinks is not None)
    return out


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, x_stride, eps, D: tl.constexpr,
                     BLOCK: tl.constexpr):
    r = tl.program_id(0)
    d = tl.arange(0, BLOCK)
    ok = d < D
    x = tl.load(x_ptr + r * x_stride + d, mask=ok, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + d, mask=ok, other=0.0)
    tl.store(out_ptr + r * D + d, (w * y.to(w.dtype)).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x [R, D] (rows may be strided) times weight [D] -> [R, D]."""
    R, D = x.shape
    assert x.stride(1) == 1
    out = torch.empty(R, D, dtype=x.dtype, device=x.device)
    _rms_norm_kernel[(R,)](x, weight, out, x.stride(0), eps, D=D,
                           BLOCK=triton.next_power_of_2(D))
    return out


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, row_stride, eps,
                         H: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr,
                         HALF_PAD: tl.constexpr, HAS_NORM: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)  # q heads 0..H-1, then the k heads
    i = tl.arange(0, HALF_PAD)
    ok = i < HALF
    base = qkv_ptr + t * row_stride + h * HD
    a = tl.load(base + i, mask=ok, other=0.0).to(tl.float32)  # the head's first half
    b = tl.load(base + HALF + i, mask=ok, other=0.0).to(tl.float32)  # and its second half
    if HAS_NORM:
        scale = tl.rsqrt((tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0)) / HD + eps)
        q_ok, k_ok = ok & (h < H), ok & (h >= H)  # a q head's weights, or a k head's
        w_a = tl.load(qn_ptr + i, mask=q_ok, other=0.0) + tl.load(kn_ptr + i, mask=k_ok,
                                                                   other=0.0)
        w_b = tl.load(qn_ptr + HALF + i, mask=q_ok, other=0.0) + tl.load(
            kn_ptr + HALF + i, mask=k_ok, other=0.0)
        a = w_a.to(tl.float32) * (a * scale)
        b = w_b.to(tl.float32) * (b * scale)
    pos = tl.load(pos_ptr + t)
    cos_a = tl.load(cos_ptr + pos * HD + i, mask=ok, other=0.0)
    cos_b = tl.load(cos_ptr + pos * HD + HALF + i, mask=ok, other=0.0)
    sin_a = tl.load(sin_ptr + pos * HD + i, mask=ok, other=0.0)
    sin_b = tl.load(sin_ptr + pos * HD + HALF + i, mask=ok, other=0.0)
    out_ty = qkv_ptr.dtype.element_ty
    tl.store(base + i, (a * cos_a - b * sin_a).to(out_ty), mask=ok)  # rotate-half, as HF
    tl.store(base + HALF + i, (b * cos_b + a * sin_b).to(out_ty), mask=ok)


def qk_norm_rope(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                 q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> None:
    """In place on qkv [T, (H + 2G) * Hd] (q | k | v): per q and k head RMSNorm (weights
    [Hd], or none) then RoPE with the rows `positions` [T] of cos/sin [N, Hd]."""
    T = qkv.shape[0]
    assert qkv.stride(1) == 1 and head_dim % 2 == 0 and (q_norm is None) == (k_norm is None)
    norm = q_norm is not None
    half = head_dim // 2
    _qk_norm_rope_kernel[(T, num_heads + num_kv_heads)](
        qkv, q_norm if norm else cos, k_norm if norm else cos, cos, sin, positions,
        qkv.stride(0), eps, H=num_heads, HD=head_dim, HALF=half,
        HALF_PAD=triton.next_power_of_2(half), HAS_NORM=norm)
