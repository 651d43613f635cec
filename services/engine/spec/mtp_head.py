"""The multi-token-prediction (MTP) head: its format on disk and its forward (DeepSeek-V3 style).

Shape legend: B sequences, T positions, D hidden, H query heads, G KV heads, Hd head dim,
I the head's dense MLP width, W the attention window.

    h_t  (the main model's last hidden state at position t, BEFORE its final norm)
    e    (the main model's embedding of token t+1)
    x = eh_proj([hnorm(h_t); enorm(e)])           2D -> D
    x += attn(rmsnorm(x))   causal, over the last W positions only (a sliding window)
    x += mlp(rmsnorm(x))    dense SwiGLU
    -> g_t (the head's hidden, fed back as "h" for a 2nd, 3rd .. draft: one head reused)
    -> the main model's final norm and lm_head -> logits of token t+2

The head lives beside the main weights, so they still load in transformers unchanged:
    strata_mtp.json     {"format": "strata-mtp", "version": 1, "file": "mtp.safetensors",
                         "config": MtpConfig fields, "training": summary}
    mtp.safetensors     `mtp.*` tensors, Hugging Face [out, in] layout
The window W keeps serving cheap: a draft recomputes the head over the last W positions
instead of keeping a KV cache for it, and training uses the same window so both agree.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

MTP_CONFIG_FILE = "strata_mtp.json"
MTP_WEIGHTS_FILE = "mtp.safetensors"
MTP_FORMAT = "strata-mtp"
DEFAULT_WINDOW = 16


@dataclass(frozen=True)
class MtpConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    window: int = DEFAULT_WINDOW
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    hidden_source: str = "pre_final_norm"  # which main-model state the head reads

    @classmethod
    def for_model(cls, c: Any, intermediate_size: int | None = None,
                  window: int = DEFAULT_WINDOW) -> MtpConfig:
        """A head shaped like the main model's attention (an engine ModelConfig)."""
        return cls(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                   intermediate_size or 2 * c.hidden_size, window, c.rms_norm_eps, c.rope_theta)

    def num_params(self) -> int:
        D, Hd = self.hidden_size, self.head_dim
        attn = D * (2 * self.num_heads + 2 * self.num_kv_heads) * Hd + 2 * Hd
        return 2 * D * D + attn + 3 * D * self.intermediate_size + 4 * D


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(
            x.dtype)


class _Attention(nn.Module):
    def __init__(self, c: MtpConfig):
        super().__init__()
        D, Hd = c.hidden_size, c.head_dim
        self.H, self.G, self.Hd = c.num_heads, c.num_kv_heads, Hd
        self.q_proj = nn.Linear(D, self.H * Hd, bias=False)
        self.k_proj = nn.Linear(D, self.G * Hd, bias=False)
        self.v_proj = nn.Linear(D, self.G * Hd, bias=False)
        self.o_proj = nn.Linear(self.H * Hd, D, bias=False)
        self.q_norm = _RMSNorm(Hd, c.rms_norm_eps)
        self.k_norm = _RMSNorm(Hd, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.H, self.Hd)).transpose(1, 2)  # [B,H,T,Hd]
        k = self.k_norm(self.k_proj(x).view(B, T, self.G, self.Hd)).transpose(1, 2)  # [B,G,T,Hd]
        v = self.v_proj(x).view(B, T, self.G, self.Hd).transpose(1, 2)  # [B,G,T,Hd]
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.H * self.Hd))


class _MLP(nn.Module):
    def __init__(self, c: MtpConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class MtpHead(nn.Module):
    def __init__(self, config: MtpConfig):
        super().__init__()
        c = self.config = config
        D = c.hidden_size
        self.hnorm = _RMSNorm(D, c.rms_norm_eps)
        self.enorm = _RMSNorm(D, c.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.input_layernorm = _RMSNorm(D, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = _RMSNorm(D, c.rms_norm_eps)
        self.mlp = _MLP(c)

    def forward(self, h: torch.Tensor, e: torch.Tensor, positions: torch.Tensor,
                valid: torch.Tensor | None = None) -> torch.Tensor:
        """h, e [B, T, D]; positions [B, T] (consecutive per row); valid [B, T] marks real
        positions (left padding at serving) -> the head's hidden g [B, T, D] (pre-norm)."""
        T = h.shape[1]
        x = self.eh_proj(torch.cat([self.hnorm(h), self.enorm(e)], dim=-1))  # [B, T, D]
        c = self.config
        inv_freq = 1.0 / c.rope_theta ** (  # fp32 whatever the head's dtype
            torch.arange(0, c.head_dim, 2, device=h.device).float() / c.head_dim)
        freqs = positions[..., None].float() * inv_freq  # [B, T, Hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, T, Hd]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        i = torch.arange(T, device=h.device)
        mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - c.window)  # [T,T]
        mask = mask[None, None]  # [1, 1, T, T]
        if valid is not None:
            eye = torch.eye(T, dtype=torch.bool, device=h.device)  # padded rows see themselves
            mask = (mask & valid[:, None, None, :]) | eye  # [B, 1, T, T]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def has_mtp_head(model_dir: str | Path | None) -> bool:
    return model_dir is not None and (Path(model_dir) / MTP_CONFIG_FILE).is_file()


def save_mtp_head(model_dir: str | Path, head: MtpHead, training: dict | None = None,
                  dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write mtp.safetensors (`mtp.*`, `dtype`) and strata_mtp.json into the checkpoint dir."""
    from safetensors.torch import save_file

    model_dir = Path(model_dir)
    tensors = {f"mtp.{k}": v.detach().to(dtype).contiguous()
               for k, v in head.state_dict().items()}
    save_file(tensors, str(model_dir / MTP_WEIGHTS_FILE), metadata={"format": "pt"})
    meta = {"format": MTP_FORMAT, "version": 1, "file": MTP_WEIGHTS_FILE,
            "dtype": str(dtype).removeprefix("torch."), "config": asdict(head.config),
            "training": training or {}}
    (model_dir / MTP_CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return model_dir / MTP_WEIGHTS_FILE


def load_mtp_config(model_dir: str | Path) -> MtpConfig:
    path = Path(model_dir) / MTP_CONFIG_FILE
    if not path.is_file():
        raise ValueError(
            f"the checkpoint {Path(model_dir).name} has no multi-token-prediction head "
            f"({MTP_CONFIG_FILE}); train one with `strata model train-mtp --model {model_dir}`")
    meta = json.loads(path.read_text())
    if meta.get("format") != MTP_FORMAT:
        raise ValueError(f"{path} is not a {MTP_FORMAT} file")
    return MtpConfig(**meta["config"])


def load_mtp_head(model_dir: str | Path, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32) -> MtpHead:
    from safetensors.torch import load_file

    config = load_mtp_config(model_dir)
    head = MtpHead(config)
    tensors = load_file(str(Path(model_dir) / MTP_WEIGHTS_FILE))
    state = {k.removeprefix("mtp."): v.to(torch.float32) for k, v in tensors.items()}
    head.load_state_dict(state, strict=True)
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)
