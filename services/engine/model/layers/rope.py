"""Rotary position embedding: cos/sin tables and their application (HF's rotate-half convention).

Shape legend: N positions, Hr rotary dims (the whole head, or the rotated part of one).

One module for every variant a family needs: the rotated dims (a whole head, MLA's rope part,
or a share of a head), the base, and interleaved pairs (DeepSeek's checkpoints rotate (0, 1),
(2, 3), ...: `interleave_perm` regroups them as rotate-half halves). Scaling variants enter as
the inverse frequencies and a factor on cos and sin (`inv_frequencies`, each as transformers'
ROPE_INIT_FUNCTIONS computes it):

    default   1 / theta^(2i / Hr)
    linear    default / factor
    dynamic   NTK-aware: theta grows once a sequence is longer than max_position_embeddings;
              the engine's context window is that length, so inside it this is default
    yarn      interpolated (/ factor) below the correction range's frequencies, extrapolated
              above it, a linear ramp between; cos and sin times attention_factor (from
              mscale / mscale_all_dim when not given). DeepSeek's attention also scales its
              softmax by mscale(factor, mscale_all_dim)^2 (`softmax_correction`, MLA applies it)
    llama3    low frequencies / factor, high ones kept, a smooth blend between
"""

from __future__ import annotations

import math

import torch

from services.engine.model.config import RopeScaling


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_factor(s: RopeScaling, max_positions: int) -> float:
    """YaRN's factor: given, or DeepSeek's max_position_embeddings / original one."""
    if s.factor is not None:
        return s.factor
    assert s.original_max_position_embeddings
    return max_positions / s.original_max_position_embeddings


def inv_frequencies(rot_dim: int, theta: float, scaling: RopeScaling | None,
                    max_positions: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [Hr/2] fp32, the factor on cos and sin) of RoPE over rot_dim dims;
    max_positions: the config's max_position_embeddings."""
    exponents = torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim
    inv_freq = 1.0 / theta ** exponents  # [Hr/2]
    if scaling is None or scaling.rope_type == "dynamic":
        return inv_freq, 1.0
    s = scaling
    if s.rope_type == "linear":
        return inv_freq / s.factor, 1.0
    if s.rope_type == "llama3":
        old = s.original_max_position_embeddings
        assert old is not None and s.factor is not None
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old / s.low_freq_factor, inv_freq / s.factor, inv_freq)
        smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        blended = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = ~(wavelen < old / s.high_freq_factor) * ~(wavelen > old / s.low_freq_factor)
        return torch.where(medium, blended, scaled), 1.0
    assert s.rope_type == "yarn" and s.original_max_position_embeddings
    factor = yarn_factor(s, max_positions)
    attention = s.attention_factor
    if attention is None:
        attention = (_mscale(factor, s.mscale) / _mscale(factor, s.mscale_all_dim)
                     if s.mscale and s.mscale_all_dim else _mscale(factor))

    def correction_dim(rotations: float) -> float:
        return (rot_dim * math.log(s.original_max_position_embeddings
                                   / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, rot_dim, 2).float() / rot_dim)
    extrapolated = 1 - ramp  # the share of each frequency kept as it is
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated
    return inv_freq, float(attention)


def softmax_correction(scaling: RopeScaling | None, max_positions: int) -> float:
    """DeepSeek's attention-scale factor under YaRN: mscale(factor, mscale_all_dim)^2 (1 for
    other RoPE or without mscale_all_dim)."""
    if scaling is None or scaling.rope_type == "default" or not scaling.mscale_all_dim:
        return 1.0
    factor = yarn_factor(scaling, max_positions) if scaling.rope_type == "yarn" else scaling.factor
    return _mscale(factor, scaling.mscale_all_dim) ** 2


class Rope:
    def __init__(self, rot_dim: int, theta: float, max_positions: int, device: torch.device,
                 scaling: RopeScaling | None = None, config_positions: int | None = None):
        """Tables for positions [0, max_positions); config_positions: the config's
        max_position_embeddings (YaRN's and dynamic NTK's reference, default max_positions)."""
        self.rot_dim = rot_dim  # Hr
        inv_freq, attention = inv_frequencies(rot_dim, theta, scaling,
                                              config_positions or max_positions)  # [Hr/2]
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [N, Hr/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [N, Hr]
        cos, sin = emb.cos(), emb.sin()
        if attention != 1.0:  # YaRN: as transformers scales them
            cos, sin = cos * attention, sin * attention
        self.cos, self.sin = cos.to(device), sin.to(device)  # [N, Hr] fp32

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, Hr] of the positions [T] (broadcast over heads)."""
        return (torch.index_select(self.cos, 0, positions)[:, None],  # (a fifth of the
                torch.index_select(self.sin, 0, positions)[:, None])  # time of cos[positions])


def rope_tables(head_dim: int, theta: float, max_num_tokens: int, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Default RoPE cos/sin tables [N, Hd] (fp32)."""
    rope = Rope(head_dim, theta, max_num_tokens, device)
    return rope.cos, rope.sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., Hr] rotated by cos/sin broadcast to it (HF's rotate-half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def interleave_perm(rot_dim: int) -> torch.Tensor:
    """[Hr] indices regrouping interleaved pairs (0, 1), (2, 3), ... as rotate-half halves."""
    return torch.cat([torch.arange(0, rot_dim, 2), torch.arange(1, rot_dim, 2)])
