"""Causal attention over the paged KV cache: grouped-query attention with its variants as
parameters, and the paged attention core that latent attention (mla.py) shares.

Shape legend: T rows in the step, N cached positions, D hidden, H query heads, G KV heads,
Hd head dim, B decode rows.

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


def single_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query token over all N keys, GQA (query head h reads KV head h // (H/G), as HF's
    repeat_kv): q [1, H, Hd], k/v [G, N, Hd] -> [1, H, Hd]; sinks [H]: a logit per head in
    the softmax that weighs no value."""
    _, H, Hd = q.shape
    G = k.shape[0]
    scores = torch.bmm(q.view(G, H // G, Hd), k.transpose(1, 2)) * Hd**-0.5  # [G, H/G, N]
    if sinks is None:
        return torch.bmm(torch.softmax(scores, dim=-1), v).view(1, H, Hd)
    with_sink = torch.cat([scores, sinks.view(G, H // G, 1).to(scores.dtype)], dim=-1)
    probs = torch.softmax(with_sink, dim=-1)[..., :-1]  # [G, H/G, N]
    return torch.bmm(probs, v).view(1, H, Hd)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
         sinks: torch.Tensor | None) -> torch.Tensor:
    """SDPA of q [B, H, t, Hd] over k, v [B, G, N, Hd] where mask [B or 1, 1, t, N] (bool)
    -> [B, H, t, Hd]. With sinks [H], each head's softmax has one more logit, the sink's, that
    weighs no value: a zero key and value column whose additive mask is the sink."""
    gqa = q.shape[1] != k.shape[1]
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    B, H, t = q.shape[0], q.shape[1], q.shape[2]
    zero = k.new_zeros(*k.shape[:2], 1, k.shape[3])
    k, v = torch.cat([k, zero], dim=2), torch.cat([v, zero], dim=2)
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask,
                                                                                float("-inf"))
    sink = sinks.to(q.dtype).view(1, H, 1, 1).expand(bias.shape[0], H, t, 1)
    bias = torch.cat([bias.expand(-1, H, t, -1), sink], dim=-1)  # [B, H, t, N + 1]
    return F.scaled_dot_product_attention(q, k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1),
                                          attn_mask=bias, enable_gqa=gqa)


def paged_attention(kv_layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    step: Step, sinks: torch.Tensor | None = None, window: int = 0
                    ) -> torch.Tensor:
    """Write k, v [T, G, Hd] to the pool at the step's slots, then causal attention of
    q [T, H, Hd] over each row's cached positions -> [T, H, Hd]; window > 0: over its last
    `window` positions only (its own included); sinks [H]: attention sinks (sdpa)."""
    kv, decode = step.kv, step.decode
    kv.write(kv_layer, step.slots, k, v)
    out = q.new_empty(q.shape) if decode is None or not decode.all_rows else None
    for s in step.spans:
        rows = slice(s.row_start, s.row_end)
        n, t = s.pos_end, s.row_end - s.row_start
        first = max(0, n - window) if window and t == 1 else 0
        k_all, v_all = kv.read(kv_layer, s.block_table, n)  # [G, N, Hd]
        if t == 1:  # a lone decode token: three small ops instead of SDPA's dispatch
            out[rows] = single_query_attention(q[rows], k_all[:, first:], v_all[:, first:],
                                               sinks)
            continue
        q_pos = torch.arange(s.pos_start, n, device=q.device)  # query i sits at pos_start + i
        k_pos = torch.arange(n, device=q.device)
        mask = q_pos[:, None] >= k_pos[None, :]  # [t, N]
        if window:
            mask &= q_pos[:, None] - k_pos[None, :] < window
        # 4-D (a batch of one): on the CPU, 3-D inputs take SDPA's math path, 4-D its flash
        # kernel (2.6x faster at 512 tokens, 32 heads of 128)
        out[rows] = sdpa(q[rows].transpose(0, 1)[None], k_all[None], v_all[None],
                         mask[None, None], sinks)[0].transpose(0, 1)  # [t, H, Hd]
    if decode is not None:
        q_rows = q if decode.all_rows else q[decode.rows]  # [B, H, Hd]
        if decode.lengths is not None:
            res = step.backend.decode_attention(q_rows, kv.k[kv_layer], kv.v[kv_layer],
                                                decode.ids, decode.lengths, decode.max_length,
                                                sinks, window)
        else:
            k_all, v_all = kv.read_batch(kv_layer, decode.ids)  # [B, G, N, Hd]
            mask = decode.mask  # [B, 1, 1, N]: each row's positions, a prefix
            if window:
                n = mask.sum(dim=-1, keepdim=True)  # [B, 1, 1, 1]
                mask = mask & (torch.arange(mask.shape[-1], device=mask.device) >= n - window)
            res = sdpa(q_rows[:, :, None], k_all, v_all, mask, sinks)[:, :, 0]  # [B, H, Hd]
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
    qkv: torch.Tensor | BlockMatrix | Fp8Matrix  # [(H+2G)*Hd, D]  q, k, v rows fused
    # by columns (or, kept as stored, their (H+2G)*Hd rows of blocks or FP8 codes)
    o: torch.Tensor | BlockMatrix | Fp8Matrix  # [D, H*Hd] (or D rows as stored)
    eps: float
    qk_norm: str = "none"  # "head": a [Hd] weight per head; "proj": over all heads; "none"
    q_norm: torch.Tensor | None = None  # [Hd] or [H*Hd]
    k_norm: torch.Tensor | None = None  # [Hd] or [G*Hd]
    qkv_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    o_bias: torch.Tensor | None = None  # [D]
    clip_qkv: float | None = None  # clamp q, k, v to [-c, c] after the q/k norm
    rotary_dim: int | None = None  # RoPE on each head's first Hr dims (glm4_moe: Hd / 2); None: all
    sinks: torch.Tensor | None = None  # [H] fp32 attention-sink logits (gpt_oss)
    window: int = 0  # > 0: sliding-window attention over the last `window` positions
    output_gate: bool = False  # qkv also yields H*Hd gate columns (after v): the output is
    # times their sigmoid before o (qwen3_next)

    capturable = True  # in a CUDA graph

    @property
    def plain(self) -> bool:
        """No bias, no clip, per-head or no q/k norm, RoPE over whole heads, no sinks or
        window, weights not in FP8: what the fused kernels compute."""
        return (self.qkv_bias is None and self.o_bias is None and self.clip_qkv is None
                and self.qk_norm in ("head", "none") and self.rotary_dim is None
                and self.sinks is None and not self.window and not self.output_gate
                and not isinstance(self.qkv, Fp8Matrix) and not isinstance(self.o, Fp8Matrix))

    def rotate(self, qkv: torch.Tensor, step: Step
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused product qkv [T, (H+2G)*Hd] of x -> q [T, H, Hd], k, v [T, G, Hd],
        normalized and rotated."""
        T, H, G, Hd = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        be = step.backend
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
        qkv = step.backend.linear(x, self.qkv)  # [T, (H+2G)*Hd] (+ H*Hd gate columns)
        gate = None
        if self.output_gate:
            qkv, gate = qkv.split([qkv.shape[1] - self.num_heads * self.head_dim,
                                   self.num_heads * self.head_dim], dim=1)
        q, k, v = self.rotate(qkv, step)
        out = paged_attention(self.kv_layer, q, k, v, step, self.sinks, self.window)  # [T, H, Hd]
        out = out.reshape(x.shape[0], -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        out = step.backend.linear(out, self.o)  # [T, D]
        return out if self.o_bias is None else out + self.o_bias
