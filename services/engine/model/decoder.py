"""The decoder: embeddings, the layer stack, the final norm and lm_head — one loop for every
family, every backend and every kind of step.

Shape legend: T tokens in this step, D hidden, V vocab, S logit rows, nb block-table columns,
Lm MoE layers, K routed per token.

    tokens -> embed -> L x DecoderLayer (attention half, then dense MLP or MoE) -> norm -> lm_head

`run_layers` is the loop. An eager step, a decode step whose attention halves run in the fused
CPU kernel (FusedDecode) and the body of a CUDA-graph capture all run it; they differ only in
the `Step` they hand the layers. Only non-expert weights live here: the MoE blocks hand each
expert's tokens to the expert source (the cache), which decides where they run. Linear weights
are [out, in], as the checkpoint stores them.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from services.engine.kernels.backend import TorchBackend
from services.engine.model.blocks import BlockMatrix
from services.engine.model.config import ModelConfig
from services.engine.model.fused_decode import FusedDecode, layer_struct
from services.engine.model.layers.decoder_layer import DecoderLayer
from services.engine.model.layers.rope import Rope
from services.engine.model.paged_kv import PagedKVCache
from services.engine.model.step import DecodeRows, ExpertSource, Span, Step

if TYPE_CHECKING:
    from services.engine.cache.expert_cache import ExpertCache


class Decoder:
    def __init__(self, config: ModelConfig, embed: torch.Tensor | BlockMatrix,
                 layers: list[DecoderLayer], final_norm: torch.Tensor,
                 lm_head: torch.Tensor | BlockMatrix, rope: Rope, backend: TorchBackend,
                 weight_dtype: torch.dtype):
        self.config = config
        self.backend = backend
        self.device = backend.device
        self.embed = embed  # [V, D] (or kept in its GGUF block type: embed_rows dequantizes)
        self.layers = layers
        self.final_norm = final_norm  # [D]
        self.lm_head = lm_head  # [S, D, V/S]
        self.rope = rope
        self.weight_dtype = weight_dtype  # the matrices' (a block-type embedding has none)
        self.dtype = backend.activation_dtype(self.weight_dtype)  # activations, norms, KV cache
        self.moe_layers = [layer.index for layer in layers if layer.moe is not None]
        self.fusable = backend.fused_decode_layer and all(layer.fusable for layer in layers)
        self._structs: tuple[PagedKVCache, ctypes.Array] | None = None
        self._fused: FusedDecode | None = None  # the fused decode step's buffers, kept
        self.last_hidden: torch.Tensor | None = None  # of the last forward
        # Layer parts with per-sequence state (linear attention's): they define release(seq_id),
        # which the runner calls when a sequence ends or is preempted, and rewind(seq_id, pos)
        # for rejected drafts.
        self.per_sequence = [part for layer in layers for part in (layer.attn, layer.mlp)
                             if callable(getattr(part, "release", None))]

    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, spans: Sequence[Span],
                kv: PagedKVCache, experts: ExpertSource, logit_rows: torch.Tensor | None,
                inputs: torch.Tensor | None = None) -> torch.Tensor:
        """One step over several sequences: token_ids, positions [T] (spans say which rows are
        whose; on the host or the device) -> fp32 logits [S, V] of logit_rows [S] (None: of
        every row, S = T). Linear
        layers and the MoE run once over all T rows; attention per sequence over its paged
        K/V. (The runner replays a pure decode step from a CUDA graph instead, where it
        captured one: model/cuda_graphs.py.) `inputs` [T, D]: the first layer's input in place
        of token_ids' embeddings (an MTP layer's, spec/checkpoint_mtp.py)."""
        token_ids, positions = token_ids.to(self.device), positions.to(self.device)
        slots = kv.span_slots(spans).to(self.device)  # [T]
        decode = self.decode_rows(spans, kv, len(token_ids))
        others = [s for s in spans if decode is None or not self._paged(s, kv)]
        step = Step(positions, self.rope, slots, others, decode, kv, experts,
                    self.backend, all_spans=spans)
        x = self.embed_rows(token_ids) if inputs is None else inputs  # [T, D]
        table = None
        if (self.fusable and decode is not None and decode.all_rows
                and decode.lengths is not None):
            step.fused = self._fused = FusedDecode.for_step(self._fused, x, step, self.layers,
                                                            self._layer_structs(kv))
            table = experts.step_table()
        if table is not None:  # every layer in one call, the lookups after it
            experts.finish_table_step(self.moe_layers, *step.fused.all_layers(table))
        else:
            x = self.run_layers(x, step)
        self.last_hidden = x  # [T, D] before the final norm (an MTP draft head reads it)
        return self.logits(x if logit_rows is None else x[logit_rows.to(self.device)])  # [S, V]

    def release(self, seq_id: int) -> None:
        """A sequence finished or was preempted: the layer parts that keep state per sequence
        outside the paged KV (a recurrent layer's, say) drop its state."""
        for part in self.per_sequence:
            part.release(seq_id)

    def rewind(self, seq_id: int, pos: int) -> None:
        """A verification step accepted the sequence's positions up to `pos` only: the layer
        parts with per-sequence state go back to there (the paged KV needs nothing: rejected
        positions are overwritten when recomputed)."""
        for part in self.per_sequence:
            part.rewind(seq_id, pos)

    def run_layers(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """The decoder loop: x [T, D] through every layer -> [T, D] before the final norm.
        Each layer's MLP output is added at the next layer's start (or here, after the last)."""
        y = None
        for layer in self.layers:
            x, h, routing = layer.attention_half(x, y, step)
            y = layer.mlp_half(h, step, routing)
        return x if y is None else x + y

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head: hidden [S, D] -> fp32 logits [S, V]."""
        be = self.backend
        return be.linear(be.rms_norm(x, self.final_norm, self.config.rms_norm_eps),
                         self.lm_head).float()

    def decode_graph_body(self, token_ids: torch.Tensor, positions: torch.Tensor,
                          decode: DecodeRows, kv: PagedKVCache, experts: ExpertCache,
                          route_top: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step with no host work at all, for capture in a CUDA graph (see
        model/cuda_graphs.py): every input on the device (decode: each row's block ids and
        length), routing on the device, each routed expert read at its address in the expert
        cache's table. Each MoE layer's top-K goes to route_top [Lm, T, K], for the cache's
        lookups after the step. -> (hidden [T, D], fp32 logits [T, V])."""
        P = kv.block_size
        block = decode.ids.gather(1, (positions // P)[:, None])[:, 0]  # [T] the new token's
        slots = block * P + positions % P  # [T] flat KV slot
        step = Step(positions, self.rope, slots, [], decode, kv, experts,
                    self.backend, route_top=route_top)
        x = self.run_layers(self.embed_rows(token_ids), step)
        return x, self.logits(x)

    def embed_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of token_ids [...] -> [..., D] in the activation dtype."""
        if isinstance(self.embed, BlockMatrix):
            return self.backend.embed_rows(self.embed, token_ids).to(self.dtype)
        rows = torch.index_select(self.embed, 0, token_ids.reshape(-1))  # (eight rows: 8 us,
        return rows.view(*token_ids.shape, -1).to(self.dtype)  # indexing embed[ids] takes 40)

    def weight_bytes(self) -> int:
        """Bytes of every non-expert weight on the device (what the budget rule subtracts)."""
        weights = self._weights()
        embed = self.embed.data if isinstance(self.embed, BlockMatrix) else self.embed
        if not any(t is embed for t in weights):
            weights.append(embed)
        return sum(t.numel() * t.element_size() for t in weights)

    def non_expert_bytes_per_step(self) -> int:
        """Bytes of the non-expert weights one step reads: every layer's attention, norms,
        router and dense or shared MLP, the final norm and lm_head, one embedding row."""
        weights = sum(t.numel() * t.element_size() for t in self._weights())
        if isinstance(self.embed, BlockMatrix):
            return weights + self.embed.row_bytes()
        return weights + self.embed.shape[1] * self.embed.element_size()

    def _weights(self) -> list[torch.Tensor]:
        """The distinct tensors of the layers, the final norm and lm_head."""
        seen: dict[int, torch.Tensor] = {}

        def collect(value: object) -> None:
            if isinstance(value, torch.Tensor):
                seen[id(value)] = value
            elif isinstance(value, tuple | list):
                for v in value:
                    collect(v)
            elif hasattr(value, "__dataclass_fields__"):
                for name in value.__dataclass_fields__:
                    if name != "next_router":  # another layer's block
                        collect(getattr(value, name))

        collect(self.layers)
        collect([self.final_norm, self.lm_head])
        return list(seen.values())

    def _layer_structs(self, kv: PagedKVCache) -> ctypes.Array:
        """Each layer's pointers for the fused decode layer, an array of kernels.DecodeLayer
        (built once per KV cache)."""
        if self._structs is None or self._structs[0] is not kv:
            structs = [layer_struct(layer, kv) for layer in self.layers]
            self._structs = (kv, (type(structs[0]) * len(structs))(*structs))
        return self._structs[1]

    def _paged(self, span: Span, kv: PagedKVCache) -> bool:
        """Whether a span's rows attend as decode rows do: one token, or a short span where
        the backend reads the pool by table (each row over its own causal length)."""
        rows = span.row_end - span.row_start
        return rows == 1 or (rows * span.pos_end <= self.backend.paged_span_pairs
                             and self._by_table(kv))

    def _by_table(self, kv: PagedKVCache) -> bool:
        """Whether the backend's kernel reads this pool's K/V by block table."""
        return self.backend.paged_attention and not kv.quantized

    def decode_rows(self, spans: Sequence[Span], kv: PagedKVCache, T: int) -> DecodeRows | None:
        """The rows of a step that attend in one call per layer: every single-token span's, and
        with a paged-attention backend every short span's (`paged_span_pairs`: row i of a span
        reads positions [0, pos_start + i], its K/V written before any row attends) — any
        number of them with the kernel; two or more decode rows with SDPA (a lone one takes
        the per-span path, which reads consecutive KV blocks as views)."""
        kernel = self._by_table(kv)
        paged = [s for s in spans if self._paged(s, kv)]
        if not paged or (len(paged) == 1 and not kernel):
            return None
        rows: list[int] = []
        tables: list[Sequence[int]] = []
        lengths: list[int] = []
        for s in paged:
            rows.extend(range(s.row_start, s.row_end))
            tables.extend([s.block_table] * (s.row_end - s.row_start))
            lengths.extend(range(s.pos_start + 1, s.pos_end + 1))
        all_rows = len(rows) == T  # (spans come in row order, none twice)
        row_ids = as_tensor(rows, self.device)
        if kernel:
            return DecodeRows(row_ids, all_rows, kv.block_ids(tables, lengths),
                              lengths=as_tensor(lengths, self.device), max_length=max(lengths))
        ids, mask = kv.gather_index(tables, lengths)
        return DecodeRows(row_ids, all_rows, ids, mask=mask[:, None, None, :])


def as_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 [len(values)] on `device`, through numpy (a third of torch.tensor's time on a
    list of ints, a few us of every step)."""
    t = torch.from_numpy(np.array(values, dtype=np.int64))
    return t if device.type == "cpu" else t.to(device)
