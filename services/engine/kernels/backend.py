"""Backends: how the dense products, norms, RoPE, decode attention and routing run on a device.

Shape legend: T rows, K input features, N output features, H query heads,
G KV heads, Hd head dim, E experts, P positions per KV block, nb blocks per table.

The runner picks one backend at start (`select_backend`, from the device and the kernels'
availability) and hands it to the model (and its C kernels to the expert cache); model code says *what* is
computed, the backend *how* on this device. Nothing here is chosen per call by inspecting
tensors, and there is no process-global kernel state: a backend holds the kernels it uses.

    TorchBackend     torch ops everywhere (the reference path; any device)
    CpuBackend       the C kernels (services/engine/kernels/cpu_kernels.c) for the products,
                     norms, q/k norm + RoPE, paged decode attention and the softmax router; a
                     whole decode layer's attention half and router in one call (`decode_layer`)
    TritonBackend    CUDA: Triton norms, q/k norm + RoPE and paged decode attention
                     (kernels/gpu_ops.py), products on GGUF block and FP8 matrices as
                     stored (kernels/gpu_blocks.py); cuBLAS products

Every backend computes the same functions; the C kernels' rows are bit-identical whatever the
batch (see cpu_kernels.c), torch's and Triton's are close.
"""

from __future__ import annotations

import ctypes
import logging
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from services.engine import kernels
from services.engine.model.blocks import BLOCK_TYPES, BlockMatrix, Fp8Matrix

if TYPE_CHECKING:
    from services.engine.cache.moe_compute import ExpertTable

log = logging.getLogger("strata.engine")


class TorchBackend:
    """Torch ops: the reference every other backend matches."""

    name = "torch"
    cpu: kernels.CpuKernels | None = None  # the C kernels, where this backend runs them
    ops: Any = None  # the kernels' module or library (CpuKernels, gpu_ops), where there are any
    paged_attention = False  # decode attention reads the KV pool by block table
    # A multi-row span (a prefill chunk) whose rows x positions is at most this attends as
    # decode rows do (paged_attention backends: each row by table over its own causal length),
    # a longer one in SDPA on its own; 0: every multi-row span in SDPA.
    paged_span_pairs = 0
    fused_rope = False  # qk_norm_rope() runs per-head q/k norm and RoPE in place
    fused_decode_layer = False  # decode_layer(): a layer's attention half + router in one call
    block_matrices: tuple[str, ...] = ()  # GGUF block types linear() reads as stored
    fp8_matrices = False  # linear() reads FP8 block-scaled matrices (Fp8Matrix) as stored

    def __init__(self, device: torch.device):
        self.device = device

    def describe(self) -> str:
        return f"{self.name} ops on {self.device}"

    def activation_dtype(self, weight_dtype: torch.dtype) -> torch.dtype:
        """What the residual stream, norms, attention and the KV cache hold for weights of
        `weight_dtype`: fp32. A product rounds its input to the weight's dtype and returns fp32
        (bf16 products over an fp32 residual stream; measured on the default model: 98.3% top-1
        agreement with the fp32 reference, 98.1% with bf16 activations throughout)."""
        return torch.float32

    # -- products ----------------------------------------------------------------------------
    def embed_rows(self, w: BlockMatrix, ids: torch.Tensor) -> torch.Tensor:
        """fp32 [*ids.shape, K]: the rows `ids` of an embedding kept in a GGUF block type."""
        return w.rows(ids)

    def matmul(self, x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
        """x [T, K] @ a pre-transposed weight w_t [K, N] -> [T, N] (small products: routers,
        gates, latent projections)."""
        return (x.to(w_t.dtype) @ w_t).to(x.dtype)

    def linear(self, x: torch.Tensor, w: torch.Tensor | BlockMatrix | Fp8Matrix
               ) -> torch.Tensor:
        """x [T, K] times the weight w [N, K] ([out, in], as the checkpoint stores it),
        transposed -> [T, N]; a BlockMatrix or Fp8Matrix is dequantized (the reference; only
        backends that read them get one at load)."""
        if isinstance(w, BlockMatrix | Fp8Matrix):
            return (x.float() @ w.dequantize().T).to(x.dtype)
        return F.linear(x.to(w.dtype), w).to(x.dtype)

    def swiglu(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(x)) * up(x)): x [T, D], gate_up [2F, D] (gate rows, then up's),
        down [D, F] -> [T, D]."""
        gu = self.linear(x, gate_up)  # [T, 2F]
        Fs = gate_up.shape[0] // 2
        return self.linear(F.silu(gu[:, :Fs]) * gu[:, Fs:], down)

    # -- norms and RoPE ------------------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim (fp32 statistics), times weight."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def qk_norm_rope(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
                     head_dim: int, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                     eps: float, cos: torch.Tensor, sin: torch.Tensor,
                     positions: torch.Tensor) -> None:
        """In place on qkv [T, (H + 2G) * Hd]: per-head q/k RMSNorm (or none), then RoPE at
        `positions` (fused_rope backends: their kernels' `ops.qk_norm_rope`)."""
        if self.ops is None:
            raise NotImplementedError(f"the {self.name} backend has no fused q/k norm + RoPE")
        self.ops.qk_norm_rope(qkv, num_heads, num_kv_heads, head_dim, q_norm, k_norm, eps, cos,
                              sin, positions)

    # -- attention -----------------------------------------------------------------------------
    def decode_attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                         block_ids: torch.Tensor, lengths: torch.Tensor, max_length: int,
                         sinks: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
        """One query token per row over its paged K/V (paged_attention backends): q [R, H, Hd],
        pools [blocks, P, G, Hd], block_ids [R, nb], lengths [R] -> [R, H, Hd]; sinks [H]
        (fp32 logits in each head's softmax with no value) and window (> 0: each row's last
        `window` positions only) as attention.py's Attention has them."""
        raise NotImplementedError(f"the {self.name} backend reads no paged KV pool")

    # -- routing -------------------------------------------------------------------------------
    def softmax_topk(self, x: torch.Tensor, router_t: torch.Tensor, k: int, renormalize: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray | None]:
        """Softmax top-k routing of x [T, D] by router_t [D, E] -> (experts [T, k], weights
        [T, k] in x's dtype, rows per expert [E] or None where the caller counts)."""
        probs = torch.softmax(self.matmul(x, router_t).float(), dim=-1)  # [T, E] fp32
        top_w, top_idx = torch.topk(probs, k, dim=-1)  # [T, K]
        if renormalize:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return top_idx, top_w.to(x.dtype), None

    def decode_layer(self, layer: kernels.DecodeLayer, step: kernels.DecodeStep) -> None:
        raise NotImplementedError(f"the {self.name} backend has no fused decode layer")


class CpuBackend(TorchBackend):
    """The C kernels on the CPU: fp32 activations, fp32 or bf16 weights; anything they do not
    take falls back to torch."""

    name = "cpu-kernels"
    paged_attention = True
    # Short prompts through the decode kernels (a step whose every span is short runs in one
    # C call): measured against a per-span SDPA, even at 128 rows from position 0 and 64 rows
    # at 400; SDPA wins from 100 rows at 400 or 16 at 3,000 (docs/benchmarks.md).
    paged_span_pairs = 128 * 128
    fused_rope = True
    fused_decode_layer = True
    block_matrices = tuple(BLOCK_TYPES)
    fp8_matrices = True

    def __init__(self, device: torch.device, cpu: kernels.CpuKernels):
        super().__init__(device)
        self.cpu = self.ops = cpu

    def describe(self) -> str:
        return f"CPU kernels ({self.cpu.path.name})"

    def activation_dtype(self, weight_dtype: torch.dtype) -> torch.dtype:
        """fp32: the kernels read bf16 weights widened into fp32 products (fp32 activations,
        fp32 accumulation), so bf16 weights cost half the bytes and nothing in accuracy."""
        return torch.float32

    @staticmethod
    def _takes(x: torch.Tensor, w: torch.Tensor) -> bool:
        return (x.dtype == torch.float32 and w.dtype in (torch.float32, torch.bfloat16)
                and x.stride(-1) == 1)

    def embed_rows(self, w: BlockMatrix, ids: torch.Tensor) -> torch.Tensor:
        return self.cpu.dequantize_rows(w, ids)  # numpy's dequantize: ~0.6 ms a decode step

    def matmul(self, x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
        if w_t.dtype == torch.bfloat16 and self._takes(x, w_t) and w_t.is_contiguous():
            return self.cpu.matmul(x, w_t)
        return super().matmul(x, w_t)  # (fp32: torch's product, as the reference computes)

    def linear(self, x: torch.Tensor, w: torch.Tensor | BlockMatrix | Fp8Matrix
               ) -> torch.Tensor:
        if isinstance(w, BlockMatrix):
            return self.cpu.linear_blocks(x.float(), w)
        if isinstance(w, Fp8Matrix):
            return self.cpu.linear_fp8(x.float(), w)
        if self._takes(x, w) and w.is_contiguous():
            return self.cpu.linear(x, w)
        return super().linear(x, w)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() == 2 and self._takes(x, weight) and weight.dtype == torch.float32:
            return self.cpu.rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def decode_attention(self, q, k_pool, v_pool, block_ids, lengths, max_length, sinks=None,
                         window=0):
        return self.cpu.decode_attention(q, k_pool, v_pool, block_ids, lengths, max_length,
                                         sinks, window)

    def softmax_topk(self, x, router_t, k, renormalize):
        if not self._takes(x, router_t):
            return super().softmax_topk(x, router_t, k, renormalize)
        # one call: logits, softmax, top-K, renormalization and the rows per expert
        return self.cpu.router(x.contiguous(), router_t, k, renormalize)

    def decode_layer(self, layer: kernels.DecodeLayer, step: kernels.DecodeStep) -> None:
        self.cpu.decode_layer(layer, step)

    def decode_step(self, layers: ctypes.Array, step: kernels.DecodeStep, table: ExpertTable,
                    route_top: np.ndarray, route_counts: np.ndarray) -> None:
        self.cpu.decode_step(layers, step, table.addresses, table.weight_types, table.ffn_size,
                             table.splits, table.mlp, table.bias_at, route_top, route_counts)


class TritonBackend(TorchBackend):
    """CUDA: Triton kernels for the attention half (services/engine/kernels/gpu_ops.py) and
    for products on weights kept in GGUF block types (kernels/gpu_blocks.py)."""

    name = "triton"
    paged_attention = True
    fused_rope = True
    block_matrices = tuple(BLOCK_TYPES)
    fp8_matrices = True

    def __init__(self, device: torch.device, gpu_ops: ModuleType, gpu_blocks: ModuleType):
        super().__init__(device)
        self.ops, self.blocks = gpu_ops, gpu_blocks

    def describe(self) -> str:
        return f"Triton kernels on {self.device}"

    def activation_dtype(self, weight_dtype: torch.dtype) -> torch.dtype:
        """The weights' dtype: the Triton expert kernel reads blobs and activations of one
        dtype (fp32 accumulation inside)."""
        return weight_dtype

    def linear(self, x: torch.Tensor, w: torch.Tensor | BlockMatrix | Fp8Matrix
               ) -> torch.Tensor:
        if isinstance(w, BlockMatrix):  # dequantized in registers, in x's dtype
            return self.blocks.linear(x, w)
        if isinstance(w, Fp8Matrix):
            return self.blocks.linear_fp8(x, w)
        return super().linear(x, w)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() == 2:
            return self.ops.rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def decode_attention(self, q, k_pool, v_pool, block_ids, lengths, max_length, sinks=None,
                         window=0):
        return self.ops.decode_attention(q, k_pool, v_pool, block_ids, lengths,
                                         q.shape[-1] ** -0.5, sinks, window)


def select_backend(device: torch.device, cpu_kernels: str = "auto") -> TorchBackend:
    """The backend for `device`: on the CPU the C kernels unless `cpu_kernels` is off (or, in
    auto, they do not build); on CUDA the Triton kernels when Triton imports; else torch ops."""
    if device.type == "cuda":
        try:
            from services.engine.kernels import gpu_blocks, gpu_ops
        except ImportError as e:
            log.warning("Triton is not importable (%s): the attention half runs as torch ops "
                        "and weights kept in GGUF block types are dequantized at load", e)
            return TorchBackend(device)
        return TritonBackend(device, gpu_ops, gpu_blocks)
    cpu = kernels.load(cpu_kernels)
    return TorchBackend(device) if cpu is None else CpuBackend(device, cpu)
