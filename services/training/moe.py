"""The trainable `qwen3_moe` model in plain torch (no transformers), fp32.

Shape legend: B sequences, T positions, N = B*T tokens, D hidden, H query heads, G KV heads,
Hd head dim, E experts, K routed per token, F expert FFN, V vocab, L layers.

    ids -> embed -> L x [ x += attn(rmsnorm(x)); x += moe(rmsnorm(x)) ] -> rmsnorm -> lm_head
    attn: q/k/v proj -> per-head RMSNorm on q, k -> RoPE (rotate-half) -> causal GQA -> o_proj
    moe:  router -> softmax (fp32) -> top-K -> renormalize (norm_topk_prob) -> SwiGLU experts
          -> weighted sum; Switch load-balancing loss E * sum_e f_e * P_e (1.0 when balanced)

Parameter names are the Hugging Face keys, except that each layer's experts are stacked
([E, F, D] / [E, D, F]); `export.hf_state_dict` splits them into per-expert keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.training.config import TrainConfig


@dataclass
class ForwardOut:
    logits: torch.Tensor  # [B, T, V]
    aux_loss: torch.Tensor  # scalar, mean over layers
    expert_counts: torch.Tensor  # [L, E] routed (token, expert) assignments, int64, detached


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))


def rope_tables(head_dim: int, theta: float, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [length, Hd] laid out for rotate-half (the HF Qwen3 convention)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    freqs = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)  # [T, Hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [T, Hd]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: TrainConfig):
        super().__init__()
        D, Hd = cfg.hidden, cfg.head_dim
        self.H, self.G, self.Hd = cfg.num_heads, cfg.num_kv_heads, Hd
        self.q_proj = nn.Linear(D, self.H * Hd, bias=False)
        self.k_proj = nn.Linear(D, self.G * Hd, bias=False)
        self.v_proj = nn.Linear(D, self.G * Hd, bias=False)
        self.o_proj = nn.Linear(self.H * Hd, D, bias=False)
        self.q_norm = RMSNorm(Hd)
        self.k_norm = RMSNorm(Hd)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.H, self.Hd)).transpose(1, 2)  # [B,H,T,Hd]
        k = self.k_norm(self.k_proj(x).view(B, T, self.G, self.Hd)).transpose(1, 2)  # [B,G,T,Hd]
        v = self.v_proj(x).view(B, T, self.G, self.Hd).transpose(1, 2)  # [B,G,T,Hd]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.H * self.Hd))


class Experts(nn.Module):
    """E SwiGLU experts with stacked weights: gate/up [E, F, D], down [E, D, F]."""

    def __init__(self, E: int, D: int, Fe: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(E, Fe, D))
        self.up_proj = nn.Parameter(torch.empty(E, Fe, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, Fe))


class SparseMoE(nn.Module):
    def __init__(self, cfg: TrainConfig):
        super().__init__()
        self.E, self.K, self.norm_topk_prob = cfg.experts, cfg.top_k, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden, cfg.experts, bias=False)  # the router
        self.experts = Experts(cfg.experts, cfg.hidden, cfg.expert_ffn)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, D] -> (y [N, D], aux loss, counts [E])."""
        N, K = x.shape[0], self.K
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [N, E]
        top_w, top_idx = torch.topk(probs, K, dim=-1)  # [N, K]
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        counts = torch.bincount(top_idx.flatten(), minlength=self.E)  # [E]
        share = counts.float() / (N * K)  # f_e: fraction of assignments (no gradient)
        aux = self.E * (share * probs.mean(dim=0)).sum()

        # Dispatch: assignments sorted by expert, each expert's rows one contiguous slice.
        order = torch.argsort(top_idx.flatten(), stable=True)  # [N*K]
        rows = order // K  # token of each sorted assignment
        xs = x.index_select(0, rows)  # [N*K, D]
        w = self.experts
        outs = []
        for e, piece in enumerate(torch.split(xs, counts.tolist())):
            if piece.shape[0]:
                h = F.silu(piece @ w.gate_proj[e].t()) * (piece @ w.up_proj[e].t())  # [n, F]
                outs.append(h @ w.down_proj[e].t())  # [n, D]
        ys = torch.cat(outs) * top_w.flatten()[order].unsqueeze(1).to(x.dtype)  # [N*K, D]
        y = torch.zeros_like(x).index_add(0, rows, ys)
        return y, aux, counts.detach()


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TrainConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden)
        self.mlp = SparseMoE(cfg)


class Backbone(nn.Module):
    def __init__(self, cfg: TrainConfig, vocab_size: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, cfg.hidden)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden)


class MoETransformer(nn.Module):
    def __init__(self, cfg: TrainConfig, vocab_size: int):
        super().__init__()
        self.cfg, self.vocab_size = cfg, vocab_size
        self.model = Backbone(cfg, vocab_size)
        self.lm_head = nn.Linear(cfg.hidden, vocab_size, bias=False)
        cos, sin = rope_tables(cfg.head_dim, cfg.rope_theta, cfg.context)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, init_std) matrices; residual outputs scaled by 1/sqrt(2L); norms at 1.
        Draws from the global generator: call torch.manual_seed(seed) first."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "experts.down_proj")):
                p.normal_(0.0, out_std)
            else:
                p.normal_(0.0, std)

    def forward(self, ids: torch.Tensor) -> ForwardOut:
        """ids [B, T] (T <= context) -> logits [B, T, V], aux loss, per-layer expert counts."""
        B, T = ids.shape
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # [T, Hd]
        x = self.model.embed_tokens(ids)  # [B, T, D]
        aux, counts = [], []
        for layer in self.model.layers:
            x = x + layer.self_attn(layer.input_layernorm(x), cos, sin)
            y, layer_aux, layer_counts = layer.mlp(
                layer.post_attention_layernorm(x).view(B * T, -1)
            )
            x = x + y.view(B, T, -1)
            aux.append(layer_aux)
            counts.append(layer_counts)
        logits = self.lm_head(self.model.norm(x))  # [B, T, V]
        return ForwardOut(logits, torch.stack(aux).mean(), torch.stack(counts))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; logits [B, T, V], targets [B, T]."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
