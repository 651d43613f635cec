"""The fused CPU decode layer: a decode step's attention half and router in one C call per
layer (cpu_kernels.c's strata_decode_layer), for models whose every layer is `fusable`.

Shape legend: T decode rows, D hidden, H / G query / KV heads, Hd head dim, E experts,
K routed per token, N the longest row's cached positions.

The decoder loop is the same as for any step (Decoder.run_layers); only a layer's attention
half runs here: x += (last MoE output); attention; h = norm(x); the router on h — each stage
the function the per-op kernels compute, so results equal theirs bit for bit.

When the expert cache can hand over every expert's address (ExpertCache.step_table: its
slot, or a miss's host blob read in place; no predictions wanted), `all_layers` runs the whole
loop in one C call instead (strata_decode_step: per layer the same attention half, then the
experts read by address), and the cache makes the step's lookups after it from the top-K each
layer left (ExpertCache.finish_table_step) — no Python between layers, the same bits.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import numpy as np
import torch

from services.engine import kernels
from services.engine.model.blocks import BlockMatrix, block_type
from services.engine.model.step import Step

if TYPE_CHECKING:
    from services.engine.cache.moe_compute import ExpertTable
    from services.engine.model.layers.decoder_layer import DecoderLayer
    from services.engine.model.layers.moe import Routing
    from services.engine.model.paged_kv import PagedKVCache


def layer_struct(layer: DecoderLayer, kv: PagedKVCache) -> kernels.DecodeLayer:
    """A layer's weight and KV-pool pointers for strata_decode_layer."""
    a, moe = layer.attn, layer.moe
    assert moe is not None and a.plain
    wtype = kernels.CpuKernels.weight_type(moe.router_t.dtype)
    qkv_types, o_type = [0, 0, 0], 0  # WT_F32: not a block type
    if isinstance(a.qkv, BlockMatrix):  # kept as stored: q | k | v rows of blocks
        assert len(a.qkv.segments) == 3
        qkv_types = [block_type(t).kernel for t in a.qkv.block_types]
        qkv = a.qkv.data
    else:  # q | k | v rows [(H + 2G) Hd, D]
        assert kernels.CpuKernels.weight_type(a.qkv.dtype) == wtype, "one weight dtype per layer"
        qkv = a.qkv
    if isinstance(a.o, BlockMatrix):
        o_type, o = block_type(a.o.block_types[0]).kernel, a.o.data
    else:  # [D, H Hd]
        assert kernels.CpuKernels.weight_type(a.o.dtype) == wtype, "one weight dtype per layer"
        o = a.o
    return kernels.DecodeLayer(
        layer.input_norm.data_ptr(), layer.post_attn_norm.data_ptr(), qkv.data_ptr(),
        None if a.q_norm is None else a.q_norm.data_ptr(),
        None if a.k_norm is None else a.k_norm.data_ptr(), o.data_ptr(),
        kv.k[a.kv_layer].data_ptr(), kv.v[a.kv_layer].data_ptr(), moe.router_t.data_ptr(),
        wtype, (ctypes.c_int64 * 3)(*qkv_types), o_type)


class FusedDecode:
    """A decode step's buffers and kernel arguments for T rows, kept from step to step while
    the count of rows and the KV cache stay (`for_step`; `bind` points them at each step's
    inputs, the attention scores growing with the longest row): made anew every step, they
    took 38-86 us of the default model's 800 / 2150 us steps (1 / 8 rows), bound 17-24 us.
    `x` [T, D] is updated in place."""

    def __init__(self, T: int, D: int, step: Step, layers: list[DecoderLayer],
                 structs: ctypes.Array):
        first = layers[0]
        a, moe = first.attn, first.moe
        assert moe is not None
        H, G, Hd = a.num_heads, a.num_kv_heads, a.head_dim
        E, K = moe.num_experts, moe.experts_per_token
        self.structs, self.backend = structs, step.backend
        self.h = torch.empty(T, D)  # each layer's MoE input
        self.qkv = torch.empty(T, (H + 2 * G) * Hd)
        self.attn, self.o = torch.empty(T, H * Hd), torch.empty(T, D)
        self.scores = torch.empty(0)  # T * max(H * max_length, E): grown by bind
        self.T, self.K, self.H, self.E = T, K, H, E
        self.top_idx = torch.empty(T, K, dtype=torch.int64)
        self.top_w = torch.empty(T, K)
        self.counts = np.empty(E, dtype=np.int64)
        self.step = kernels.DecodeStep(
            T, D, H, G, Hd, step.kv.block_size, E, K, moe.renormalize, 0, 0, first.eps,
            Hd**-0.5, None, None, None, None, None, None, None, None, self.h.data_ptr(),
            self.qkv.data_ptr(), self.attn.data_ptr(), self.o.data_ptr(), None,
            self.top_idx.data_ptr(), self.top_w.data_ptr(), self.counts.ctypes.data)

    @classmethod
    def for_step(cls, last: FusedDecode | None, x: torch.Tensor, step: Step,
                 layers: list[DecoderLayer], structs: ctypes.Array) -> FusedDecode:
        """The last step's buffers (None: none yet) bound to this step's, or new ones when its
        count of rows or the layers' pointers changed (`structs` are made once per KV cache:
        Decoder._layer_structs)."""
        fused, (T, D) = last, x.shape
        if fused is None or fused.T != T or fused.structs is not structs:
            fused = cls(T, D, step, layers, structs)
        fused.bind(x, step)
        return fused

    def bind(self, x: torch.Tensor, step: Step) -> None:
        """This step's inputs: its rows' positions, KV slots, block tables and lengths, x."""
        decode = step.decode
        assert decode is not None and decode.lengths is not None and x.is_contiguous()
        assert x.shape[0] == self.T
        need = self.T * max(self.H * decode.max_length, self.E)
        s = self.step
        if self.scores.numel() < need:  # twice what this step needs: regrown rarely
            self.scores = torch.empty(2 * need)
            s.scores = self.scores.data_ptr()
        s.table_stride, s.max_length = decode.ids.stride(0), decode.max_length
        s.cos_table, s.sin_table = step.rope.cos.data_ptr(), step.rope.sin.data_ptr()
        s.positions, s.slots = step.positions.data_ptr(), step.slots.data_ptr()
        s.tables, s.lengths = decode.ids.data_ptr(), decode.lengths.data_ptr()
        s.x, s.add = x.data_ptr(), None

    def attention_half(self, layer: DecoderLayer, x: torch.Tensor, y: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor, Routing]:
        """x += y; attention; h = norm(x); router(h) — in place on x, h and the routing."""
        self.step.add = None if y is None else y.data_ptr()
        self.backend.decode_layer(self.structs[layer.index], self.step)
        return x, self.h, (self.top_idx, self.top_w, self.counts)

    def all_layers(self, table: ExpertTable) -> tuple[np.ndarray, np.ndarray]:
        """Every layer in one call, x ending as the last layer's output plus its experts' sum
        (what run_layers returns), the routed experts read at table.addresses -> each layer's
        top-K [L, T, K] and rows per expert [L, E], for the cache's lookups."""
        L = len(self.structs)
        route_top = np.empty((L, self.T, self.K), dtype=np.int64)
        route_counts = np.empty((L, self.E), dtype=np.int64)
        self.step.add = None
        self.backend.decode_step(self.structs, self.step, table, route_top, route_counts)
        return route_top, route_counts
