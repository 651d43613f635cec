"""Causal attention over the paged KV cache: grouped-query attention with its variants as
parameters, and the paged attention core that latent attention (mla.py) shares.

Shape legend: T rows in the step, N cached positions, D hidden, H query heads, G KV heads,
Hd head dim, B decode rows, S column splits.

    x -> fused q/k/v product (+ bias) -> q/k RMSNorm (per head, over the projection, or none)
      -> (clip) -> RoPE -> K/V written to the paged pool -> attention -> o product (+ bias)

Attention per step: each multi-token span (a prefill chunk) on its own, causal, in SDPA; the
decode rows in one call — the backend's paged kernel reading each row's blocks by table, or
one batched SDPA over gathered blocks; a lone decode row without a kernel as three small ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.engine.model.blocks import BlockMatrix, Fp8Matrix
from services.engine.model.layers.rope import apply_rope
from services.engine.model.step import Step


def single_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One query token over all N keys, GQA (query head h reads KV head h // (H/G), as HF's
    repeat_kv): q [1, H, Hd], k/v [G, N, Hd] -> [1, H, Hd]."""
    _, H, Hd = q.shape
    G = k.shape[0]
    scores = torch.bmm(q.view(G, H // G, Hd), k.transpose(1, 2)) * Hd**-0.5  # [G, H/G, N]
    return torch.bmm(torch.softmax(scores, dim=-1), v).view(1, H, Hd)


def paged_attention(kv_layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    step: Step) -> torch.Tensor:
    """Write k, v [T, G, Hd] to the pool at the step's slots, then causal attention of
    q [T, H, Hd] over each row's cached positions -> [T, H, Hd]."""
    kv, decode = step.kv, step.decode
    kv.write(kv_layer, step.slots, k, v)
    gqa = q.shape[1] != k.shape[1]
    out = q.new_empty(q.shape) if decode is None or not decode.all_rows else None
    for s in step.spans:
        rows = slice(s.row_start, s.row_end)
        n, t = s.pos_end, s.row_end - s.row_start
        k_all, v_all = kv.read(kv_layer, s.block_table, n)  # [G, N, Hd]
        if t == 1:  # a lone decode token: three small ops instead of SDPA's dispatch
            out[rows] = single_query_attention(q[rows], k_all, v_all)
            continue
        q_pos = torch.arange(s.pos_start, n, device=q.device)  # query i sits at pos_start + i
        mask = q_pos[:, None] >= torch.arange(n, device=q.device)[None, :]  # [t, N]
        # 4-D (a batch of one): on the CPU, 3-D inputs take SDPA's math path, 4-D its flash
        # kernel (2.6x faster at 512 tokens, 32 heads of 128)
        out[rows] = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1)[None], k_all[None], v_all[None], attn_mask=mask,
            enable_gqa=gqa,
        )[0].transpose(0, 1)  # [t, H, Hd]
    if decode is not None:
        q_rows = q if decode.all_rows else q[decode.rows]  # [B, H, Hd]
        if decode.lengths is not None:
            res = step.backend.decode_attention(q_rows, kv.k[kv_layer], kv.v[kv_layer],
                                                decode.ids, decode.lengths, decode.max_length)
        else:
            k_all, v_all = kv.read_batch(kv_layer, decode.ids)  # [B, G, N, Hd]
            res = F.scaled_dot_product_attention(
                q_rows[:, :, None], k_all, v_all, attn_mask=decode.mask, enable_gqa=gqa,
            )[:, :, 0]  # [B, H, Hd]
        if out is None:
            out = res
        else:
            out[decode.rows] = res
    assert out is not None
    return out


@dataclass
class Attention:
    """Grouped-query attention; its variants are parameters, not subclasses."""

    kv_layer: int  # this layer's index in the KV pool
    num_heads: int  # H
    num_kv_heads: int  # G
    head_dim: int  # Hd
    qkv: torch.Tensor | BlockMatrix | Fp8Matrix  # [S, D, (H+2G)*Hd/S]  q, k, v fused, split
    # by columns (or, kept as stored, their (H+2G)*Hd rows of blocks or FP8 codes)
    o: torch.Tensor | BlockMatrix | Fp8Matrix  # [S, H*Hd, D/S] (or D rows as stored)
    eps: float
    qk_norm: str = "none"  # "head": a [Hd] weight per head; "proj": over all heads; "none"
    q_norm: torch.Tensor | None = None  # [Hd] or [H*Hd]
    k_norm: torch.Tensor | None = None  # [Hd] or [G*Hd]
    qkv_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    o_bias: torch.Tensor | None = None  # [D]
    clip_qkv: float | None = None  # clamp q, k, v to [-c, c] after the q/k norm
    rotary_dim: int | None = None  # RoPE on each head's first Hr dims (glm4_moe: Hd / 2); None: all

    capturable = True  # in a CUDA graph

    @property
    def plain(self) -> bool:
        """No bias, no clip, per-head or no q/k norm, RoPE over whole heads, weights not in
        FP8: what the fused kernels compute."""
        return (self.qkv_bias is None and self.o_bias is None and self.clip_qkv is None
                and self.qk_norm in ("head", "none") and self.rotary_dim is None
                and not isinstance(self.qkv, Fp8Matrix) and not isinstance(self.o, Fp8Matrix))

    def project(self, x: torch.Tensor, step: Step
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> q [T, H, Hd], k, v [T, G, Hd], normalized and rotated."""
        T, H, G, Hd = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        be = step.backend
        qkv = be.linear(x, self.qkv)  # [T, (H+2G)*Hd]
        if be.fused_rope and self.plain:  # per-head norm and RoPE in one call, in place
            be.qk_norm_rope(qkv, H, G, Hd, self.q_norm, self.k_norm, self.eps, step.rope.cos,
                            step.rope.sin, step.positions)
            q, k, v = qkv.split([H * Hd, G * Hd, G * Hd], dim=1)
            return q.view(T, H, Hd), k.view(T, G, Hd), v.view(T, G, Hd)
        q, k, v = qkv.split([H * Hd, G * Hd, G * Hd], dim=1)  # [T, H*Hd], [T, G*Hd] x 2
        if self.qkv_bias is not None:
            q, k, v = q + self.qkv_bias[0], k + self.qkv_bias[1], v + self.qkv_bias[2]
        if self.qk_norm == "proj":  # olmoe: one norm over all heads
            q, k = be.rms_norm(q, self.q_norm, self.eps), be.rms_norm(k, self.k_norm, self.eps)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q, k, v = q.view(T, H, Hd), k.view(T, G, Hd), v.view(T, G, Hd)
        if self.qk_norm == "head":
            q, k = be.rms_norm(q, self.q_norm, self.eps), be.rms_norm(k, self.k_norm, self.eps)
        if self.rotary_dim is None:
            return apply_rope(q, step.cos, step.sin), apply_rope(k, step.cos, step.sin), v
        r = self.rotary_dim  # rotate the first r dims of each head, pass the rest
        q = torch.cat([apply_rope(q[..., :r], step.cos, step.sin), q[..., r:]], dim=-1)
        k = torch.cat([apply_rope(k[..., :r], step.cos, step.sin), k[..., r:]], dim=-1)
        return q, k, v

    def __call__(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """x [T, D] (normalized) -> [T, D]."""
        q, k, v = self.project(x, step)
        out = paged_attention(self.kv_layer, q, k, v, step)  # [T, H, Hd]
        out = step.backend.linear(out.reshape(x.shape[0], -1), self.o)  # [T, D]
        return out if self.o_bias is None else out + self.o_bias
