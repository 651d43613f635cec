"""The dense SwiGLU MLP: dense layers of MoE models, and shared experts (resident, every token
runs them; never a cache pair).

Shape legend: T rows, D hidden, F FFN size, S column splits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.model.step import Step


@dataclass
class DenseMlp:
    gate_up: torch.Tensor  # [2, D, F] gate, up (pre-transposed)
    down: torch.Tensor  # [S, F, D/S]
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
