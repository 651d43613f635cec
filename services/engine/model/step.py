"""What one forward pass hands every layer: the step's rows, KV slots, RoPE rows, attention
groups, the expert source and the backend.

Shape legend: T rows in the step, B decode rows, nb block-table columns, P positions per KV
block, Hr rotary dims, Lm MoE layers, K routed per token.

A step holds the tokens of any number of sequences (continuous batching): each sequence's
rows are one `Span`. Spans of one token (decode rows) attend in one call per layer
(`DecodeRows`, where the backend reads the paged pool by block table or SDPA gathers it);
longer spans (prefill chunks) one by one.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from services.engine.kernels.backend import TorchBackend
    from services.engine.model.layers.rope import Rope
    from services.engine.model.paged_kv import PagedKVCache


class ExpertSource(Protocol):
    """Where routed experts run (services.engine.cache.expert_cache.ExpertCache); per MoE layer
    and step: route() once, predict() when wanted, then apply() — or, for a step that reads
    them by table (step_table()), one finish_table_step() after it."""

    @property
    def wants_predictions(self) -> bool:
        """Whether predict() should be called this step (prefetch on with pairs left to
        prefetch, or routing recorded)."""
        ...

    def route(self, layer: int, top_idx: torch.Tensor, counts: np.ndarray) -> None:
        """This step's routing of `layer` (top_idx [T, K] on the host, counts [E] int64: rows
        routed to each expert)."""
        ...

    def predict(self, layer: int, predicted: torch.Tensor) -> None:
        """Experts [T, K] predicted for `layer` before it runs."""
        ...

    def apply(self, layer: int, x: torch.Tensor, top_idx: torch.Tensor,
              top_w: torch.Tensor) -> torch.Tensor:
        """The routed experts of `layer` on x [T, D] (top_idx [T, K] on the host, top_w [T, K]):
        [T, D], each row the sum of its K experts' outputs times their weights, added in
        ascending expert id whatever the residency (results never depend on the cache)."""
        ...

    def step_table(self) -> Any:
        """An ExpertTable (cache/moe_compute.py) when this step may read every expert by
        address and make its lookups after it (finish_table_step) with the same outcome as
        route() per layer; else None."""
        ...

    def finish_table_step(self, moe_layers: Sequence[int], top_idx: np.ndarray,
                          counts: np.ndarray) -> None:
        """The lookups of a step that read its experts by table: top_idx [Lm, T, K], counts
        [Lm, E] (rows routed to each expert)."""
        ...


@dataclass(frozen=True)
class Span:
    """Rows [row_start, row_end) of a step: one sequence's tokens at positions
    [pos_start, pos_start + rows), its K/V in `block_table`'s blocks of the paged cache."""

    row_start: int
    row_end: int
    pos_start: int
    block_table: Sequence[int]
    seq_id: int = -1  # whose tokens (layers with per-sequence state key it by this)
    drafts: int = 0  # its last `drafts` rows are drafts to verify (speculative decoding)

    @property
    def pos_end(self) -> int:
        return self.pos_start + self.row_end - self.row_start


@dataclass(frozen=True)
class DecodeRows:
    """A step's single-token (decode) rows, whose attention runs as one call per layer: the
    backend's paged kernel (`lengths` set) or one batched SDPA over gathered blocks (`mask`)."""

    rows: torch.Tensor  # [B] their rows in the step
    all_rows: bool  # rows == 0..T-1: every row of the step is a decode row
    ids: torch.Tensor  # [B, nb] block ids, padded with block 0
    mask: torch.Tensor | None = None  # [B, 1, 1, nb * P] positions each row has (SDPA)
    lengths: torch.Tensor | None = None  # [B] positions each row has (paged kernel)
    max_length: int = 0


@dataclass
class Step:
    """One forward pass as the layers see it."""

    positions: torch.Tensor  # [T]
    rope: Rope  # the model's tables (fused kernels read rows by position)
    slots: torch.Tensor  # [T] flat KV slot of each row's new K/V
    spans: Sequence[Span]  # spans attended one by one (prefill chunks; a lone decode row)
    decode: DecodeRows | None  # the decode rows attended together
    kv: PagedKVCache
    experts: Any  # ExpertSource; in a graphed step the ExpertCache (apply_graphed)
    backend: TorchBackend
    route_top: torch.Tensor | None = None  # graphed step: each MoE layer's top-K [Lm, T, K]
    all_spans: Sequence[Span] = ()  # every span, decode rows' too (per-sequence state)
    fused: Any = None  # model.fused_decode.FusedDecode: the CPU fused decode layer's buffers

    @functools.cached_property
    def rope_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, Hr]: the RoPE rows of the positions, gathered when a layer first
        wants them (a fused decode step reads the tables by position and never does)."""
        return self.rope.rows(self.positions)

    @property
    def cos(self) -> torch.Tensor:
        return self.rope_rows[0]

    @property
    def sin(self) -> torch.Tensor:
        return self.rope_rows[1]

    @property
    def graphed(self) -> bool:
        """A step captured in a CUDA graph: no host work inside it (routing on the device,
        experts read at their addresses in the cache's table, lookups after the replay)."""
        return self.route_top is not None
