"""The dense SwiGLU MLP: dense layers of MoE models, and shared experts (resident, every token
runs them; never a cache pair); and what a routed expert computes on its weights (ExpertMlp).

Shape legend: T rows, D hidden, F FFN size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.engine.model.config import ModelConfig
from services.engine.model.step import Step


@dataclass
class DenseMlp:
    gate_up: torch.Tensor  # [2F, D] gate rows, then up's
    down: torch.Tensor  # [D, F]
    gate_t: torch.Tensor | None = None  # [D, 1] a sigmoid gate on the output (qwen2_moe's
    # shared expert); None: ungated

    plain = False  # no fused decode kernel (that computes MoE layers)
    capturable = True

    def __call__(self, h: torch.Tensor, step: Step) -> torch.Tensor:
        """h [T, D] -> down(silu(gate(h)) * up(h)) [T, D] (times sigmoid(h @ gate_t))."""
        y = step.backend.swiglu(h, self.gate_up, self.down)
        if self.gate_t is not None:
            y = torch.sigmoid(step.backend.matmul(h, self.gate_t)) * y
        return y


ACTIVATIONS = ("silu", "clamped")


@dataclass(frozen=True)
class ExpertMlp:
    """What a routed expert computes on its gate, up and down weights:

        silu      down(silu(gate x) * up x)                                   (SwiGLU)
        clamped   g = min(gate x, limit), u = clamp(up x, -limit, limit),
                  down(g * sigmoid(alpha g) * (u + 1))                        (gpt-oss)

    with `bias`: each expert adds its own gate, up and down biases to the products (held in
    its blob, cache/formats.py). The C and Triton MoE kernels take the same parameters."""

    act: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0
    bias: bool = False

    def __post_init__(self) -> None:
        assert self.act in ACTIVATIONS, self.act

    @classmethod
    def of(cls, config: ModelConfig) -> ExpertMlp:
        """What a model's routed experts compute."""
        return cls(config.expert_act, config.swiglu_alpha, config.swiglu_limit,
                   config.expert_bias)

    @property
    def plain(self) -> bool:
        return self.act == "silu" and not self.bias

    def activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate, up [n, F] (biases added) -> the input of down [n, F]."""
        if self.act == "silu":
            return F.silu(gate) * up
        g = gate.clamp(max=self.limit)
        return g * torch.sigmoid(self.alpha * g) * (up.clamp(-self.limit, self.limit) + 1)

    def forward(self, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        """The torch reference: x [n, D], gate / up [F, D], down [D, F], bias [2F + D] or None
        -> [n, D]."""
        Fs = gate.shape[0]
        g, u = x @ gate.T, x @ up.T
        if bias is not None:
            g, u = g + bias[:Fs], u + bias[Fs:2 * Fs]
        y = self.activation(g, u) @ down.T
        return y if bias is None else y + bias[2 * Fs:]


SWIGLU = ExpertMlp()  # the experts of every family but gpt_oss
