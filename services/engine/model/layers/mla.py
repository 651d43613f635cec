"""Multi-head latent attention (DeepSeek-V2/V3), over a cache of the latent.

Shape legend as in attention.py, plus R the KV latent rank, Rq the query latent rank, Dn / Dr
the no-RoPE / RoPE parts of a q/k head (Hd = Dn + Dr), Dv the value head dim, L = R + Dr.

    q = q_proj(x)  or  q_b(rmsnorm(q_a(x)))                                [T, H, Dn + Dr]
    c, k_rot = split(kv_a(x)); c = rmsnorm(c)                               [T, R], [T, Dr]
    RoPE on the Dr parts (k_rot shared by all heads)

kv_b maps the latent to each head's k_nope (W_UK [H, Dn, R]) and v (W_UV [H, Dv, R]). Instead
of expanding it per head, the pool caches what every head shares, [c | k_rot] (one "head" of
L values a position, K and V one tensor), and the per-head maps move to the query and the
output ("absorbed"):

    q_nope . k_nope = (q_nope W_UK) . c       so  q' = [q_nope W_UK | q_rot]     [T, H, L]
    softmax(q' . [c | k_rot]) @ [c | k_rot]   ->  its first R values, then W_UV  [T, H, Dv]

which is the same attention (scores and weighted values) as the expanded form, computed by
the ordinary paged attention with H query heads on one KV head of L dims. Its softmax scale
(1 / sqrt(L)) is corrected on q' to the model's 1 / sqrt(Hd) (times DeepSeek's YaRN factor).
The pool holds L values a position and layer: 576 for DeepSeek-V3 against H * 2 * Hd = 49,152
expanded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from services.engine.model.blocks import Fp8Matrix
from services.engine.model.layers.attention import paged_attention
from services.engine.model.layers.rope import apply_rope
from services.engine.model.step import Step


def _per_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, H, a] times w [H, a, b] per head -> [T, H, b] (in x's dtype)."""
    return torch.bmm(x.transpose(0, 1).to(w.dtype), w).transpose(0, 1).to(x.dtype)


@dataclass
class LatentAttention:
    kv_layer: int
    num_heads: int  # H
    head_dim: int  # Hd = Dn + Dr
    rope_dim: int  # Dr
    v_head_dim: int  # Dv
    kv_lora_rank: int  # R
    eps: float
    q: torch.Tensor | Fp8Matrix | None  # [H*Hd, D]  (no query latent; or as stored)
    q_a: torch.Tensor | None  # [D, Rq]
    q_a_norm: torch.Tensor | None  # [Rq]
    q_b: torch.Tensor | Fp8Matrix | None  # [H*Hd, Rq] (or as stored)
    kv_a: torch.Tensor  # [D, R + Dr]
    kv_a_norm: torch.Tensor  # [R]
    w_uk: torch.Tensor  # [H, Dn, R]  kv_b's k_nope rows per head
    w_uv_t: torch.Tensor  # [H, R, Dv]  kv_b's v rows per head, transposed
    o: torch.Tensor | Fp8Matrix  # [D, H*Dv] (or as stored)
    rope_perm: torch.Tensor | None  # [Dr] interleaved pairs -> rotate-half layout
    softmax_scale: float = 1.0  # the attention scale times this (DeepSeek's YaRN mscale^2)

    plain = False  # no fused kernel computes latent attention
    capturable = False  # not captured in CUDA graphs (not tested there)

    def project(self, x: torch.Tensor, step: Step
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> q' [T, H, L] (absorbed, scaled) and the cached [c | k_rot] [T, 1, L]."""
        T, H, Hd, Dr = x.shape[0], self.num_heads, self.head_dim, self.rope_dim
        Dn, be = Hd - Dr, step.backend
        if self.q is not None:
            q = be.linear(x, self.q)
        else:
            q = be.linear(be.rms_norm(be.matmul(x, self.q_a), self.q_a_norm, self.eps), self.q_b)
        q = q.view(T, H, Hd)
        latent, k_rot = be.matmul(x, self.kv_a).split([self.kv_lora_rank, Dr], dim=-1)  # [T, R], [T, Dr]
        c = be.rms_norm(latent, self.kv_a_norm, self.eps)  # [T, R]
        q_rot, k_rot = q[..., Dn:], k_rot[:, None]  # [T, H, Dr], [T, 1, Dr]
        if self.rope_perm is not None:  # HF rotates interleaved pairs: regroup as halves
            q_rot, k_rot = q_rot[..., self.rope_perm], k_rot[..., self.rope_perm]
        q_rot = apply_rope(q_rot, step.cos, step.sin)
        k_rot = apply_rope(k_rot, step.cos, step.sin)
        q_lat = _per_head(q[..., :Dn], self.w_uk)  # [T, H, R]
        L = self.kv_lora_rank + Dr
        # SDPA and the decode kernels scale by 1 / sqrt(L): make it 1 / sqrt(Hd) * correction
        scale = self.softmax_scale * math.sqrt(L / Hd)
        q_abs = torch.cat([q_lat, q_rot], dim=-1) * scale  # [T, H, L]
        return q_abs, torch.cat([c[:, None], k_rot], dim=-1)  # [T, H, L], [T, 1, L]

    def __call__(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        q, kv = self.project(x, step)
        out = paged_attention(self.kv_layer, q, kv, kv, step)[..., : self.kv_lora_rank]
        out = _per_head(out, self.w_uv_t)  # [T, H, Dv]
        return step.backend.linear(out.reshape(x.shape[0], -1), self.o)  # [T, D]
