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
    """One decode step's buffers and kernel arguments; `x` [T, D] is updated in place."""

    def __init__(self, x: torch.Tensor, step: Step, layers: list[DecoderLayer],
                 structs: ctypes.Array):
        decode, first = step.decode, layers[0]
        assert decode is not None and decode.lengths is not None and x.is_contiguous()
        a, moe = first.attn, first.moe
        assert moe is not None
        T, D = x.shape
        H, G, Hd = a.num_heads, a.num_kv_heads, a.head_dim
        E, K = moe.num_experts, moe.experts_per_token
        self.structs, self.backend = structs, step.backend
        self.h = torch.empty(T, D)  # each layer's MoE input
        self.qkv = torch.empty(T, (H + 2 * G) * Hd)
        self.attn, self.o = torch.empty(T, H * Hd), torch.empty(T, D)
        self.scores = torch.empty(max(T * H * decode.max_length, T * E))
        self.T, self.K = T, K
        self.top_idx = torch.empty(T, K, dtype=torch.int64)
        self.top_w = torch.empty(T, K)
        self.counts = np.empty(E, dtype=np.int64)
        self.step = kernels.DecodeStep(
            T, D, H, G, Hd, step.kv.block_size, E, K, moe.renormalize, decode.ids.stride(0),
            decode.max_length, first.eps, Hd**-0.5, step.rope.cos.data_ptr(),
            step.rope.sin.data_ptr(), step.positions.data_ptr(), step.slots.data_ptr(),
            decode.ids.data_ptr(), decode.lengths.data_ptr(), x.data_ptr(), None,
            self.h.data_ptr(), self.qkv.data_ptr(), self.attn.data_ptr(), self.o.data_ptr(),
            self.scores.data_ptr(), self.top_idx.data_ptr(), self.top_w.data_ptr(),
            self.counts.ctypes.data)

    def attention_half(self, layer: DecoderLayer, x: torch.Tensor, y: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor, Routing]:
        """x += y; attention; h = norm(x); router(h) — in place on x, h and the routing."""
        self.step.add = None if y is None else y.data_ptr()
        self.backend.decode_layer(self.structs[layer.index], self.step)
        return x, self.h, (self.top_idx, self.top_w, self.counts)

    def all_layers(self, table: ExpertTable) -> np.ndarray:
        """Every layer in one call, x ending as the last layer's output plus its experts' sum
        (what run_layers returns), the routed experts read at table.addresses -> each layer's
        top-K [L, T, K] for the cache's lookups."""
        route_top = np.empty((len(self.structs), self.T, self.K), dtype=np.int64)
        self.step.add = None
        self.backend.decode_step(self.structs, self.step, table, route_top)
        return route_top
