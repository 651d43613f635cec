"""Multi-head latent attention (DeepSeek-V2/V3).

Shape legend as in attention.py, plus R the KV latent rank, Rq the query latent rank, Dn / Dr
the no-RoPE / RoPE parts of a q/k head (Hd = Dn + Dr), Dv the value head dim.

    q = q_proj(x)  or  q_b(rmsnorm(q_a(x)))                                [T, H, Dn + Dr]
    c, k_rot = split(kv_a(x)); k_nope, v = split(kv_b(rmsnorm(c)))         [T, Dr], [T, H, Dn|Dv]
    RoPE on the Dr parts (k_rot shared by all heads); V zero-padded to Hd

The latent is expanded to per-head K/V before the paged cache (the cache stores H heads of Hd,
like any other family's); the padding keeps one head dim for K and V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.model.layers.attention import paged_attention
from services.engine.model.layers.rope import apply_rope
from services.engine.model.step import Step


@dataclass
class LatentAttention:
    kv_layer: int
    num_heads: int  # H
    head_dim: int  # Hd = Dn + Dr
    rope_dim: int  # Dr
    v_head_dim: int  # Dv
    kv_lora_rank: int  # R
    eps: float
    q: torch.Tensor | None  # [S, D, H*Hd/S]  (no query latent)
    q_a: torch.Tensor | None  # [D, Rq]
    q_a_norm: torch.Tensor | None  # [Rq]
    q_b: torch.Tensor | None  # [S, Rq, H*Hd/S]
    kv_a: torch.Tensor  # [D, R + Dr]
    kv_a_norm: torch.Tensor  # [R]
    kv_b: torch.Tensor  # [S, R, H*(Dn+Dv)/S]
    o: torch.Tensor  # [S, H*Dv, D/S]
    rope_perm: torch.Tensor | None  # [Dr] interleaved pairs -> rotate-half layout
    softmax_scale: float = 1.0  # on q: the attention scale times this (DeepSeek's YaRN mscale^2)

    plain = False  # no fused kernel computes latent attention
    capturable = False  # not captured in CUDA graphs (not tested there)

    def project(self, x: torch.Tensor, step: Step
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> q, k, v [T, H, Hd] with RoPE applied (v zero-padded from Dv)."""
        T, H, Hd, Dr, Dv = x.shape[0], self.num_heads, self.head_dim, self.rope_dim, \
            self.v_head_dim
        Dn, be = Hd - Dr, step.backend
        if self.q is not None:
            q = be.linear(x, self.q)
        else:
            q = be.linear(be.rms_norm(be.matmul(x, self.q_a), self.q_a_norm, self.eps), self.q_b)
        q = q.view(T, H, Hd)
        latent, k_rot = be.matmul(x, self.kv_a).split([self.kv_lora_rank, Dr], dim=-1)  # [T, R], [T, Dr]
        kv = be.linear(be.rms_norm(latent, self.kv_a_norm, self.eps), self.kv_b)
        k_nope, v = kv.view(T, H, Dn + Dv).split([Dn, Dv], dim=-1)  # [T, H, Dn], [T, H, Dv]
        q_rot, k_rot = q[..., Dn:], k_rot[:, None]  # [T, H, Dr], [T, 1, Dr]
        if self.rope_perm is not None:  # HF rotates interleaved pairs: regroup as halves
            q_rot, k_rot = q_rot[..., self.rope_perm], k_rot[..., self.rope_perm]
        q = torch.cat([q[..., :Dn], apply_rope(q_rot, step.cos, step.sin)], dim=-1)
        if self.softmax_scale != 1.0:  # q.k / sqrt(Hd) * c: the scale on q, not on the cache
            q = q * self.softmax_scale
        k_rot = apply_rope(k_rot, step.cos, step.sin).expand(T, H, Dr)
        k = torch.cat([k_nope, k_rot], dim=-1)  # [T, H, Hd]
        v = torch.nn.functional.pad(v, (0, Hd - Dv))  # [T, H, Hd]
        return q, k, v

    def __call__(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        q, k, v = self.project(x, step)
        out = paged_attention(self.kv_layer, q, k, v, step)[..., : self.v_head_dim]
        return step.backend.linear(out.reshape(x.shape[0], -1), self.o)  # [T, D]
