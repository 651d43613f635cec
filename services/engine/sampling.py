"""Token sampling: greedy at temperature 0, otherwise temperature -> top-k -> top-p -> draw.

Draws use a per-request torch.Generator on the CPU, so a seeded request is reproducible
regardless of the device or of other requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    def __init__(self, cfg: SamplingConfig):
        self.cfg = cfg
        self._gen = torch.Generator(device="cpu")
        if cfg.seed is None:
            self._gen.seed()
        else:
            self._gen.manual_seed(cfg.seed)

    def sample(self, logits: torch.Tensor) -> int:
        """logits [V] -> one token id."""
        if self.cfg.greedy:
            return int(torch.argmax(logits))
        return self.draw(self.probs(logits))

    def draw(self, probs: torch.Tensor) -> int:
        """One token id from probs [V] (sums to 1), with this request's generator."""
        return int(torch.multinomial(probs, 1, generator=self._gen))

    def uniform(self) -> float:
        """One draw from U[0, 1) with this request's generator (speculative acceptance)."""
        return float(torch.rand(1, generator=self._gen))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution drawn from: [V] fp32, zero outside the top-k / top-p support."""
        scaled = logits.detach().float().cpu() / self.cfg.temperature  # [V]
        if 0 < self.cfg.top_k < scaled.shape[0]:
            keep = torch.topk(scaled, self.cfg.top_k).indices
            cut = torch.full_like(scaled, float("-inf"))
            cut[keep] = scaled[keep]
            scaled = cut
        probs = torch.softmax(scaled, dim=-1)
        if self.cfg.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above each token
            sorted_p[before >= self.cfg.top_p] = 0.0  # the first token always stays
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
            probs = probs / probs.sum()
        return probs
