"""One decoder layer: x += attention(norm(x)); x += mlp(norm(x)), with the MLP's residual add
deferred to the next layer's start, which is where the fused CPU decode layer adds it.

Shape legend: T rows, D hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.model.layers.attention import Attention
from services.engine.model.layers.delta_net import GatedDeltaNet
from services.engine.model.layers.mla import LatentAttention
from services.engine.model.layers.mlp import DenseMlp
from services.engine.model.layers.moe import MoeBlock, Routing
from services.engine.model.step import Step


@dataclass
class DecoderLayer:
    index: int
    input_norm: torch.Tensor  # [D]
    post_attn_norm: torch.Tensor  # [D]
    attn: Attention | LatentAttention | GatedDeltaNet
    mlp: DenseMlp | MoeBlock
    eps: float

    @property
    def moe(self) -> MoeBlock | None:
        return self.mlp if isinstance(self.mlp, MoeBlock) else None

    @property
    def fusable(self) -> bool:
        """Whether the fused CPU decode layer computes it: plain attention, a softmax-routed
        MoE without a shared expert."""
        return self.attn.plain and self.moe is not None and self.moe.plain

    @property
    def capturable(self) -> bool:
        """Whether a CUDA graph can capture it (every op on the device, no host decision)."""
        return self.attn.capturable and self.mlp.capturable

    def attention_half(self, x: torch.Tensor, y: torch.Tensor | None, step: Step
                       ) -> tuple[torch.Tensor, torch.Tensor, Routing | None]:
        """x [T, D] plus the last layer's MLP output y -> (x after attention, the MLP's
        normalized input h [T, D], the routing when the fused kernel computed it)."""
        if step.fused is not None:
            return step.fused.attention_half(self, x, y)
        be = step.backend
        if y is not None:
            x = x + y
        x = x + self.attn(be.rms_norm(x, self.input_norm, self.eps), step)
        return x, be.rms_norm(x, self.post_attn_norm, self.eps), None

    def mlp_half(self, h: torch.Tensor, step: Step, routing: Routing | None) -> torch.Tensor:
        if routing is None:
            return self.mlp(h, step)
        assert self.moe is not None
        return self.moe(h, step, routing)
