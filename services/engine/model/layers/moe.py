"""The sparse MoE block: a router, the routed experts through the expert source (the cache),
and an optional shared expert.

Shape legend: T rows, D hidden, E experts, K routed per token, Gr expert groups.

    router logits = h @ router_t (+ a bias: gpt_oss)                  [T, E]
    softmax top-K (renormalized where the family does)  | grouped top-K (DeepSeek)
      | top-K of the biased logits, then softmax over them (gpt_oss)
    experts.route(layer, top_idx, counts)   one lookup per distinct pair
    experts.predict(next MoE layer, its router on h)   next-layer prefetch, when wanted
    y = experts.apply(layer, h, top_idx, top_w) (+ shared expert(h))

Routing runs on the backend (the C router on the CPU: one call for logits, softmax, top-K and
counts). In a step captured in a CUDA graph everything stays on the device: the top-K is
recorded for the cache's lookups after the replay and the experts are read at the addresses
of the cache's table.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.engine.model.layers.mlp import DenseMlp
from services.engine.model.step import Step


@dataclass(frozen=True)
class GroupedRouting:
    """DeepSeek's routing: softmax (V2) or sigmoid (V3, + a score-correction bias for the
    choice) scores, the top `topk_groups` of `num_groups` groups, weights times a scaling."""

    scoring: str  # "softmax" | "sigmoid"
    num_groups: int
    topk_groups: int
    scaling: float

    def __call__(self, logits: torch.Tensor, k: int, renormalize: bool,
                 bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [T, E] fp32 -> (weights [T, K], experts [T, K]). V3 keeps the groups whose
        two best biased scores sum highest, V2 ranks groups by their best score; weights are
        the unbiased scores."""
        T, E = logits.shape
        sigmoid = self.scoring == "sigmoid"
        scores = logits.sigmoid() if sigmoid else logits.softmax(dim=-1)  # [T, E]
        choice = scores if bias is None else scores + bias
        per_group = E // self.num_groups
        groups = choice.view(T, self.num_groups, per_group)  # [T, Gr, E/Gr]
        if sigmoid:
            group_scores = groups.topk(min(2, per_group), dim=-1).values.sum(-1)  # [T, Gr]
        else:
            group_scores = groups.max(dim=-1).values  # [T, Gr]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(self.topk_groups, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
        top_idx = choice.topk(k, dim=-1).indices  # [T, K]
        top_w = scores.gather(1, top_idx)
        if renormalize:
            top_w = top_w / (top_w.sum(dim=-1, keepdim=True) + 1e-20)
        return top_w * self.scaling, top_idx


Routing = tuple[torch.Tensor, torch.Tensor, np.ndarray | None]  # top_idx, top_w, counts [E]


@dataclass
class MoeBlock:
    layer: int  # the pair's layer id (the decoder layer's index)
    moe_index: int  # its place among the MoE layers (a graphed step's route_top row)
    num_experts: int  # E
    experts_per_token: int  # K
    renormalize: bool  # top-K weights renormalized to sum 1
    router_t: torch.Tensor  # [D, E]
    router_bias: torch.Tensor | None = None  # [E] score correction (grouped routing)
    grouped: GroupedRouting | None = None  # None: softmax top-K
    shared: DenseMlp | None = None
    next_router: MoeBlock | None = None  # the next MoE layer (next-layer prefetch)
    logit_bias: torch.Tensor | None = None  # [E] added to the router's logits (gpt_oss)

    @property
    def capturable(self) -> bool:
        """Grouped routing is not captured in CUDA graphs (not tested there)."""
        return self.grouped is None

    @property
    def plain(self) -> bool:
        """Softmax top-K routing and no shared expert: what the fused kernels compute."""
        return self.grouped is None and self.shared is None and self.logit_bias is None

    def logits(self, h: torch.Tensor, step: Step) -> torch.Tensor:
        """The router's logits [T, E] of h [T, D]."""
        logits = step.backend.matmul(h, self.router_t)
        return logits if self.logit_bias is None else logits + self.logit_bias

    def route(self, h: torch.Tensor, step: Step) -> Routing:
        """h [T, D] -> (top_idx [T, K], top_w [T, K], counts [E] or None), on h's device."""
        if self.logit_bias is not None:  # top-K of the logits, softmax over those K
            top_v, top_idx = torch.topk(self.logits(h, step).float(), self.experts_per_token,
                                        dim=-1)
            return top_idx, torch.softmax(top_v, dim=-1).to(h.dtype), None
        if self.grouped is None:
            return step.backend.softmax_topk(h, self.router_t, self.experts_per_token,
                                             self.renormalize)
        top_w, top_idx = self.grouped(self.logits(h, step).float(), self.experts_per_token,
                                      self.renormalize, self.router_bias)
        return top_idx, top_w.to(h.dtype), None

    def __call__(self, h: torch.Tensor, step: Step, routing: Routing | None = None
                 ) -> torch.Tensor:
        """h [T, D] (normalized) -> [T, D]; `routing`: computed already (fused decode layer)."""
        top_idx, top_w, counts = routing if routing is not None else self.route(h, step)
        if step.graphed:
            assert step.route_top is not None
            step.route_top[self.moe_index].copy_(top_idx)
            y = step.experts.apply_graphed(self.layer, h, top_idx, top_w)
        else:
            top_idx = top_idx.cpu()  # [T, K]
            if counts is None:
                counts = torch.bincount(top_idx.flatten(), minlength=self.num_experts).numpy()
            step.experts.route(self.layer, top_idx, counts)  # one lookup per distinct expert
            nxt = self.next_router
            if nxt is not None and step.experts.wants_predictions:
                # Prefetch: the next MoE layer's router on this layer's input predicts its
                # experts (softmax is monotonic: top-K of the logits is top-K of the scores).
                next_logits = nxt.logits(h, step)  # [T, E]
                step.experts.predict(nxt.layer, torch.topk(next_logits, self.experts_per_token,
                                                           dim=-1).indices)  # [T, K]
            y = step.experts.apply(self.layer, h, top_idx, top_w)  # [T, D]
        if self.shared is not None:
            y = y + self.shared(h, step)
        return y
