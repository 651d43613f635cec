"""Rotary position embedding: cos/sin tables and their application (HF's rotate-half convention).

Shape legend: N positions, Hr rotary dims (the whole head, or the rotated part of one).

One module for every variant a family needs: the rotated dims (a whole head, or MLA's rope
part), the base, and interleaved pairs (DeepSeek's checkpoints rotate (0, 1), (2, 3), ...:
`interleave_perm` regroups them as rotate-half halves). Scaling variants (linear, NTK, YaRN)
enter here as parameters of the inverse frequencies.
"""

from __future__ import annotations

import torch


class Rope:
    def __init__(self, rot_dim: int, theta: float, max_positions: int, device: torch.device):
        self.rot_dim = rot_dim  # Hr
        inv_freq = 1.0 / theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float()
                                   / rot_dim)  # [Hr/2]
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [N, Hr/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [N, Hr]
        self.cos, self.sin = emb.cos().to(device), emb.sin().to(device)  # [N, Hr] fp32

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, Hr] of the positions [T] (broadcast over heads)."""
        return self.cos[positions][:, None], self.sin[positions][:, None]


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
