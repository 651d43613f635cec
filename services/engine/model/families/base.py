"""What a family file declares (`Family`), and the builders it assembles its layers with.

Shape legend: D hidden, F FFN, E experts, H / G query / KV heads, Hd head dim.

A family is a `model_type`: how its config.json maps to ModelConfig fields, where its tensors
live (WeightNames), and its layer list (`build_layer(tensors, config, i)`). The builders here
read a layer's tensors into the building blocks of model/layers/: linear weights [out, in] as
the checkpoint stores them (what the backends take), routers and gates pre-transposed.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from services.engine.model.blocks import BLOCK_TYPES, BlockMatrix, Fp8Matrix, fp8_kept
from services.engine.model.config import ModelConfig, WeightNames
from services.engine.model.layers.attention import Attention
from services.engine.model.layers.decoder_layer import DecoderLayer
from services.engine.model.layers.mlp import DenseMlp
from services.engine.model.layers.moe import GroupedRouting, MoeBlock

RawConfig = dict[str, Any]


@dataclass(frozen=True)
class Family:
    model_type: str
    weight_names: WeightNames
    # config.json -> the ModelConfig fields this family sets beyond the common ones
    config_fields: Callable[[RawConfig], dict[str, Any]]
    # (tensors, config, layer index) -> that decoder layer
    build_layer: Callable[[Tensors, ModelConfig, int], DecoderLayer]


class TensorReader(Protocol):
    """What the builders read tensors through (model/checkpoint.py, model/gguf_reader.py)."""

    def __contains__(self, name: str) -> bool: ...

    def get(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor: ...

    def stored_dtype(self, name: str) -> str: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def blocks(self, name: str) -> tuple[str, np.ndarray]: ...

    def fp8(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None: ...

    fp8_block: tuple[int, int]  # an FP8 checkpoint's scale blocks


def file_backed(rows: np.ndarray) -> torch.Tensor:
    """uint8 [bytes] over a tensor's bytes where the reader maps them (a GGUF file's pages,
    read in place: no copy, pages loaded as lookups touch them). The mapping is read-only;
    nothing writes weights, so torch's warning about non-writable arrays is silenced here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.ascontiguousarray(rows).reshape(-1))


class Tensors:
    """A checkpoint's tensors as the layers hold them, on the device: matrices in the weight
    dtype (linear weights [out, in], routers and gates pre-transposed), vectors (norms, biases) in the
    activation dtype."""

    def __init__(self, reader: TensorReader, dtype: torch.dtype, device: torch.device,
                 act_dtype: torch.dtype | None = None, blocks: tuple[str, ...] = (),
                 fp8: bool = False):
        self.reader, self.dtype, self.device = reader, dtype, device
        self.act_dtype = act_dtype or dtype
        self.blocks = blocks  # GGUF block types the backend's linear() reads as stored
        self.fp8 = fp8  # whether it reads FP8 block-scaled matrices as stored

    def __contains__(self, name: str) -> bool:
        return name in self.reader

    def get(self, name: str) -> torch.Tensor:
        """A vector (norm weight, bias) in the activation dtype."""
        return self.reader.get(name, self.act_dtype).to(self.device)

    def matrix(self, name: str) -> torch.Tensor:
        """A matrix as stored ([out, in], e.g. the embeddings) in the weight dtype."""
        return self.reader.get(name, self.dtype).to(self.device)

    def embedding(self, name: str) -> torch.Tensor | BlockMatrix:
        """An embedding table [V, D]: kept in its block type (rows dequantized per lookup, by
        torch ops on any backend) when stored in one, else matrix()."""
        stored = self.reader.stored_dtype(name)
        if stored in BLOCK_TYPES:
            _, rows = self.reader.blocks(name)
            return BlockMatrix(file_backed(rows).to(self.device), self.reader.shape(name)[1],
                               ((stored, rows.shape[0]),))
        return self.matrix(name)

    def get_t(self, name: str) -> torch.Tensor:
        """A [out, in] weight as a contiguous [in, out] on the device."""
        return self.reader.get(name, self.dtype).t().contiguous().to(self.device)

    def rows(self, *names: str) -> torch.Tensor:
        """[out_i, in] weights, concatenated along out -> [sum(out), in] on the device."""
        return torch.cat([self.reader.get(n, self.dtype) for n in names]).to(self.device)

    def linear(self, *names: str) -> torch.Tensor | BlockMatrix | Fp8Matrix:
        """[out_i, in] weights for backend.linear, concatenated along out: kept as stored
        (their rows of blocks, a BlockMatrix; FP8 codes and block scales, an Fp8Matrix) when
        every one is in a type the backend reads, else rows() in the weight dtype."""
        if self.fp8 and (matrix := self._fp8(names)) is not None:
            return matrix
        stored = [self.reader.stored_dtype(n) for n in names] if self.blocks else []
        if stored and set(stored) <= set(self.blocks):
            parts = [self.reader.blocks(n)[1] for n in names]
            data = (file_backed(parts[0]) if len(parts) == 1 else  # one tensor: read in place
                    torch.from_numpy(np.concatenate([np.asarray(b).reshape(-1) for b in parts])))
            return BlockMatrix(data.to(self.device), self.reader.shape(names[0])[1],
                               tuple((t, b.shape[0]) for t, b in zip(stored, parts, strict=True)))
        return self.rows(*names)

    def _fp8(self, names: tuple[str, ...]) -> Fp8Matrix | None:
        """The tensors as one Fp8Matrix when each is FP8 with block scales and their shapes
        concatenate (blocks.fp8_kept); else None."""
        shapes = [self.reader.shape(n) for n in names]
        block = self.reader.fp8_block
        if (any(self.reader.stored_dtype(n) != "F8_E4M3" or len(s) != 2
                for n, s in zip(names, shapes, strict=True))
                or not fp8_kept(shapes, block)):  # type: ignore[arg-type]
            return None  # checked before anything is read
        parts = [self.reader.fp8(n) for n in names]
        if any(p is None for p in parts):
            return None
        codes = torch.cat([c for c, _ in parts])  # type: ignore[misc]
        scales = torch.cat([s for _, s in parts])  # type: ignore[misc]
        return Fp8Matrix(codes.to(self.device), scales.to(self.device), block)

    def swiglu(self, prefix: str, gate: str | None = None) -> DenseMlp:
        """{prefix}.{gate,up,down}_proj as a DenseMlp (gate: a sigmoid output gate's name)."""
        return DenseMlp(self.rows(f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"),
                        self.rows(f"{prefix}.down_proj.weight"),
                        None if gate is None else self.get_t(f"{gate}.weight"))


def gqa_attention(t: Tensors, c: ModelConfig, i: int, bias: bool = False,
                  qkv: torch.Tensor | None = None) -> Attention:
    """model.layers.i.self_attn's q/k/v/o (+ biases, + q/k norms) as an Attention; `qkv`: the
    fused product's weights where the family lays them out itself."""
    a = f"model.layers.{i}.self_attn"
    norms = c.qk_norm != "none"
    if qkv is None:
        qkv = t.linear(f"{a}.q_proj.weight", f"{a}.k_proj.weight", f"{a}.v_proj.weight")
    return Attention(
        kv_layer=c.kv_layers.index(i), num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim, qkv=qkv,
        o=t.linear(f"{a}.o_proj.weight"), eps=c.rms_norm_eps, qk_norm=c.qk_norm,
        q_norm=t.get(f"{a}.q_norm.weight") if norms else None,
        k_norm=t.get(f"{a}.k_norm.weight") if norms else None,
        qkv_bias=tuple(t.get(f"{a}.{p}_proj.bias") for p in "qkv") if bias else None,  # type: ignore[arg-type]
        o_bias=t.get(f"{a}.o_proj.bias") if c.attention_o_bias else None,
        clip_qkv=c.clip_qkv, rotary_dim=rotary_dim(c))


def rotary_dim(c: ModelConfig) -> int | None:
    """The rotated dims of a GQA head (partial_rotary_factor), or None: all of them."""
    return None if c.partial_rotary_factor == 1.0 else int(c.head_dim * c.partial_rotary_factor)


def moe_block(t: Tensors, c: ModelConfig, i: int, names: WeightNames) -> MoeBlock:
    """Layer i's router (+ correction bias, + shared expert) as a MoeBlock; its routed experts
    are not loaded here (the host store holds them)."""
    moe = f"model.layers.{i}.{names.moe}"
    shared = None
    if c.shared_expert_intermediate_size:
        gate = f"{moe}.{names.shared_gate}" if names.shared_gate else None
        shared = t.swiglu(f"{moe}.{names.shared}", gate)
    grouped = None
    if c.grouped_routing:
        grouped = GroupedRouting(c.router_scoring, c.num_groups, c.topk_groups,
                                 c.routed_scaling_factor)
    bias = f"{moe}.{names.router_bias}"
    return MoeBlock(
        layer=i, moe_index=c.moe_layers.index(i), num_experts=c.num_experts,
        experts_per_token=c.experts_per_token, renormalize=c.norm_topk_prob,
        router_t=t.get_t(f"{moe}.{names.router}.weight"),
        router_bias=t.get(bias) if bias in t else None, grouped=grouped, shared=shared,
        logit_bias=t.get(f"{moe}.{names.router}.bias") if c.router_logit_bias else None)


def decoder_layer(t: Tensors, c: ModelConfig, i: int, attn: Any, names: WeightNames
                  ) -> DecoderLayer:
    """Layer i with `attn`: a MoE block where the config routes, else a dense SwiGLU MLP."""
    p = f"model.layers.{i}"
    mlp = moe_block(t, c, i, names) if c.is_moe_layer(i) else t.swiglu(f"{p}.mlp")
    return DecoderLayer(i, t.get(f"{p}.input_layernorm.weight"),
                        t.get(f"{p}.post_attention_layernorm.weight"), attn, mlp,
                        c.rms_norm_eps)


def gqa_family(model_type: str, names: WeightNames,
               config_fields: Callable[[RawConfig], dict[str, Any]]) -> Family:
    """A family of GQA layers (biases as its config says) over MoE or dense MLPs."""

    def build_layer(t: Tensors, c: ModelConfig, i: int) -> DecoderLayer:
        return decoder_layer(t, c, i, gqa_attention(t, c, i, c.attention_bias), names)

    return Family(model_type, names, config_fields, build_layer)
