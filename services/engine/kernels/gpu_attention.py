"""Decode attention on a CUDA device over the paged KV cache, read by block table (Triton).

Shape legend: T decode tokens (one per sequence), H query heads, G KV heads, Hd head dim,
B blocks in the pool, P positions per block, nb block-table columns.

    decode_attention(q [T, H, Hd], k, v [B, P, G, Hd] (one layer's pool),
                     block_ids [T, nb], lengths [T], scale) -> [T, H, Hd]

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
def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, ids_ptr, len_ptr, out_ptr, scale, ids_stride,
                             H: tl.constexpr, G: tl.constexpr, HD: tl.constexpr,
                             P: tl.constexpr, QH: tl.constexpr, QH_PAD: tl.constexpr,
                             HD_PAD: tl.constexpr, P_PAD: tl.constexpr):
    t = tl.program_id(0)
    g = tl.program_id(1)
    n = tl.load(len_ptr + t)
    qh = tl.arange(0, QH_PAD)
    hd = tl.arange(0, HD_PAD)
    p = tl.arange(0, P_PAD)
    q_ok = (qh[:, None] < QH) & (hd[None, :] < HD)
    q = tl.load(q_ptr + t * H * HD + (g * QH + qh)[:, None] * HD + hd[None, :], mask=q_ok,
                other=0.0).to(tl.float32)  # [QH_PAD, HD_PAD]
    m_i = tl.full((QH_PAD,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((QH_PAD,), dtype=tl.float32)
    acc = tl.zeros((QH_PAD, HD_PAD), dtype=tl.float32)
    for b in range(0, tl.cdiv(n, P)):
        block = tl.load(ids_ptr + t * ids_stride + b)
        pos_ok = (p < P) & (b * P + p < n)  # [P_PAD]
        kv_off = ((block * P + p)[:, None] * G + g) * HD + hd[None, :]  # [P_PAD, HD_PAD]
        kv_ok = pos_ok[:, None] & (hd[None, :] < HD)
        k = tl.load(k_ptr + kv_off, mask=kv_ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + kv_off, mask=kv_ok, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [QH_PAD, P_PAD]
        s = tl.where(pos_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every block has a position
        alpha = tl.exp(m_i - m_new)
        w = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(w, axis=1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + t * H * HD + (g * QH + qh)[:, None] * HD + hd[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_ok)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_ids: torch.Tensor,
                     lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, H, Hd]; k, v [B, P, G, Hd]; block_ids [T, nb]; lengths [T] (>= 1) -> [T, H, Hd]."""
    T, H, Hd = q.shape
    _, P, G, _ = k.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    _decode_attention_kernel[(T, G)](
        q, k, v, block_ids, lengths, out, scale, block_ids.stride(0), H=H, G=G, HD=Hd, P=P,
        QH=H // G, QH_PAD=triton.next_power_of_2(H // G), HD_PAD=triton.next_power_of_2(Hd),
        P_PAD=triton.next_power_of_2(P))
    return out
