"""DeepSeek-V2/V3's pieces that the shared forward (model/qwen3_moe.py) cannot express as flags:
multi-head latent attention (MLA) and sigmoid grouped top-k routing.

Shape legend as in qwen3_moe.py, plus R the KV latent rank, Dn / Dr the no-RoPE / RoPE parts of a
q/k head (Hd = Dn + Dr), Dv the value head dim, Gr expert groups.

    MLA:  q = q_proj(x) (or q_b(rmsnorm(q_a(x))))                          [T, H, Dn + Dr]
          c, k_rot = split(kv_a(x)); k_nope, v = split(kv_b(rmsnorm(c)))   [T, Dr], [T, H, Dn|Dv]
          RoPE on the Dr parts (k_rot shared by all heads); V zero-padded to Hd
The latent is expanded to per-head K/V before the paged cache (no latent cache: the cache stores
H heads of Hd, like any other family); the padding keeps one head dim for K and V.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.engine.cache.layout import matmul_split
from services.engine.model import qwen3_moe as base
from services.engine.model.config import ModelConfig


@dataclass
class MlaWeights:
    q: torch.Tensor | None  # [S, D, H*Hd/S]  (q_lora_rank 0)
    q_a: torch.Tensor | None  # [D, Rq]
    q_a_norm: torch.Tensor | None  # [Rq]
    q_b: torch.Tensor | None  # [S, Rq, H*Hd/S]
    kv_a: torch.Tensor  # [D, R + Dr]
    kv_a_norm: torch.Tensor  # [R]
    kv_b: torch.Tensor  # [S, R, H*(Dn+Dv)/S]
    rope_perm: torch.Tensor | None  # [Dr] interleaved pairs -> rotate-half layout


def load_mla(
    get: Callable[[str], torch.Tensor],
    get_split: Callable[[str], torch.Tensor],
    prefix: str,
    c: ModelConfig,
) -> MlaWeights:
    """get(name) -> a device tensor, get_split(name) -> its [S, in, out/S] split."""
    lora = c.q_lora_rank > 0
    Dr = c.qk_rope_head_dim
    perm = torch.cat([torch.arange(0, Dr, 2), torch.arange(1, Dr, 2)]) if c.rope_interleave \
        else None
    return MlaWeights(
        q=None if lora else get_split(f"{prefix}.q_proj.weight"),
        q_a=get(f"{prefix}.q_a_proj.weight").t().contiguous() if lora else None,
        q_a_norm=get(f"{prefix}.q_a_layernorm.weight") if lora else None,
        q_b=get_split(f"{prefix}.q_b_proj.weight") if lora else None,
        kv_a=get(f"{prefix}.kv_a_proj_with_mqa.weight").t().contiguous(),
        kv_a_norm=get(f"{prefix}.kv_a_layernorm.weight"),
        kv_b=get_split(f"{prefix}.kv_b_proj.weight"),
        rope_perm=perm,
    )


def mla_qkv(
    c: ModelConfig, w: MlaWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, D] -> q, k, v [T, H, Hd] with RoPE applied (v zero-padded from Dv); cos/sin
    [T, 1, Dr]."""
    T, H, Hd, Dr, Dv = x.shape[0], c.num_heads, c.head_dim, c.qk_rope_head_dim, c.v_head_dim
    Dn, eps = Hd - Dr, c.rms_norm_eps
    if w.q is not None:
        q = matmul_split(x, w.q)
    else:
        q = matmul_split(base.rms_norm(x @ w.q_a, w.q_a_norm, eps), w.q_b)
    q = q.view(T, H, Hd)
    latent, k_rot = (x @ w.kv_a).split([c.kv_lora_rank, Dr], dim=-1)  # [T, R], [T, Dr]
    kv = matmul_split(base.rms_norm(latent, w.kv_a_norm, eps), w.kv_b).view(T, H, Dn + Dv)
    k_nope, v = kv.split([Dn, Dv], dim=-1)  # [T, H, Dn], [T, H, Dv]
    q_rot, k_rot = q[..., Dn:], k_rot[:, None]  # [T, H, Dr], [T, 1, Dr]
    if w.rope_perm is not None:  # HF rotates interleaved pairs: regroup as rotate-half halves
        q_rot, k_rot = q_rot[..., w.rope_perm], k_rot[..., w.rope_perm]
    q = torch.cat([q[..., :Dn], base.apply_rope(q_rot, cos, sin)], dim=-1)  # [T, H, Hd]
    k_rot = base.apply_rope(k_rot, cos, sin).expand(T, H, Dr)
    k = torch.cat([k_nope, k_rot], dim=-1)  # [T, H, Hd]
    v = torch.nn.functional.pad(v, (0, Hd - Dv))  # [T, H, Hd]
    return q, k, v


def grouped_topk(
    c: ModelConfig, logits: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek routing, logits [T, E] fp32 -> (weights [T, K], experts [T, K]). V3: sigmoid
    scores, the choice adds the correction bias and keeps the topk_groups groups whose two best
    scores sum highest; V2: softmax scores, groups ranked by their best score. Weights are the
    unbiased scores (renormalized where configured), times the scaling."""
    T, E = logits.shape
    sigmoid = c.router_scoring == "sigmoid"
    scores = logits.sigmoid() if sigmoid else logits.softmax(dim=-1)  # [T, E]
    choice = scores if bias is None else scores + bias
    groups = choice.view(T, c.num_groups, E // c.num_groups)  # [T, Gr, E/Gr]
    if sigmoid:
        group_scores = groups.topk(min(2, E // c.num_groups), dim=-1).values.sum(-1)  # [T, Gr]
    else:
        group_scores = groups.max(dim=-1).values  # [T, Gr]
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(c.topk_groups, dim=-1).indices, True)
    choice = choice.masked_fill(~keep.repeat_interleave(E // c.num_groups, dim=1), float("-inf"))
    top_idx = choice.topk(c.experts_per_token, dim=-1).indices  # [T, K]
    top_w = scores.gather(1, top_idx)
    if c.norm_topk_prob:
        top_w = top_w / (top_w.sum(dim=-1, keepdim=True) + 1e-20)
    return top_w * c.routed_scaling_factor, top_idx
