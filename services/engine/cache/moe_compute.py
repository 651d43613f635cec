"""A layer's routed experts, computed on blobs wherever the cache put them.

Shape legend: T tokens in the step, K routed per token, E experts, D hidden, n rows routed to
one expert.

The expert cache decides where each routed expert's bytes are read from (its slot, a staging
copy, or the host store in place) and hands this module one `Placed` per layer: each expert's
blob view and, on CUDA, the copy it must wait for. What computes on them is chosen once, from
the format and the device (`moe_compute`):

    CpuMoe      the C kernel strata_moe: every routed expert of the layer in one call, each
                blob read by address where it lies (`table`: what a decode step that runs
                every layer in one call, strata_decode_step, reads them by)
    TritonMoe   CUDA: services.engine.kernels.gpu_moe, the same by address (slots, staging
                copies, the pinned host store over the link), dense, GGUF block or FP8 blobs
                dequantized in registers; the groups whose bytes are ready
                launch first, those waiting on a copy after the compute stream has waited
    TorchMoe    anything else (int8/int4, no compiler, no Triton): rows grouped by
                expert with one gather, the format's torch ops per expert (a host blob on a
                CUDA engine computed by the CPU), one scatter-add

Each returns [T, D]: per token the sum of its experts' outputs times their weights, in
ascending expert id whatever the placement.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from services.engine.cache.formats import ExpertFormat, device_kernel
from services.engine.cache.layout import num_splits

if TYPE_CHECKING:
    from services.engine.kernels import CpuKernels


@dataclass
class Placed:
    """Where this layer's routed experts are read from."""

    blobs: dict[int, torch.Tensor]  # expert -> its blob (a slot, a staging copy, a host row)
    ready: dict[int, torch.cuda.Event] = field(default_factory=dict)  # expert -> copy to wait
    counts: np.ndarray | None = None  # [E] rows routed to each expert
    layer: int = 0


@dataclass(frozen=True)
class ExpertTable:
    """Every pair's blob address and how the C kernel reads them, for a decode step that reads
    its routed experts by table (kernels.CpuKernels.decode_step) and looks them up after."""

    addresses: np.ndarray  # [L, E] int64, kept current by the cache's fills
    weight_types: np.ndarray  # [L, 5] strata_moe's wtypes of each layer
    ffn_size: int  # F
    splits: int  # work units of the down products (their output rows in parts)
    mlp: Any  # model.layers.mlp.ExpertMlp
    bias_at: int


class CpuMoe:
    kind = "cpu-kernel"

    def __init__(self, cpu: CpuKernels, fmt: ExpertFormat, num_experts: int):
        self.cpu, self.format = cpu, fmt
        self._addr = np.zeros(num_experts, dtype=np.int64)  # [E] this layer's blob addresses

    def __call__(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor,
                 placed: Placed) -> torch.Tensor:
        for expert, blob in placed.blobs.items():
            self._addr[expert] = blob.data_ptr()
        f = self.format.at(placed.layer)
        return self.cpu.moe(x.contiguous(), top_idx, top_w.contiguous(), self._addr, f.ffn_size,
                            num_splits(f.hidden_size), weights=f.kernel_weights,
                            block_types=f.kernel_types, fp8_block=f.kernel_block, mlp=f.mlp,
                            bias_at=f.bias_at)

    def table(self, addresses: np.ndarray) -> ExpertTable | None:
        """An ExpertTable over addresses [L, E]; None when the layers' experts differ in
        shape or activation (one call takes one of each; block types may differ by layer)."""
        fs = [self.format.at(layer) for layer in range(addresses.shape[0])]
        if len({(f.ffn_size, f.hidden_size, f.mlp, f.bias_at) for f in fs}) != 1:
            return None
        f = fs[0]
        types = np.stack([self.cpu.moe_weight_types(f.kernel_weights, f.kernel_types,
                                                    f.kernel_block) for f in fs])
        return ExpertTable(addresses, types, f.ffn_size, num_splits(f.hidden_size), f.mlp,
                           f.bias_at)


class TritonMoe:
    kind = "triton"

    def __init__(self, gpu: ModuleType, fmt: ExpertFormat, num_experts: int,
                 device: torch.device):
        self.gpu, self.format, self.device = gpu, fmt, device
        self._addr = np.zeros(num_experts, dtype=np.int64)
        self._by_layer: dict[int, Any] = {}  # layer -> gpu_moe.Weights

    def __call__(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor,
                 placed: Placed) -> torch.Tensor:
        pending = np.zeros(len(self._addr), dtype=bool)  # [E] waits for a copy
        for expert, blob in placed.blobs.items():
            self._addr[expert] = blob.data_ptr()  # a pinned host blob: read over the link
        for expert in placed.ready:
            pending[expert] = True
        waits = list(placed.ready.values())
        groups = self.gpu.group_rows(top_idx.numpy(), ~pending if waits else None)

        def wait_for_copies() -> None:
            compute = torch.cuda.current_stream(self.device)
            for ready in waits:
                compute.wait_event(ready)

        f = self.format.at(placed.layer)
        return self.gpu.moe(x, top_w, groups, self._addr, f.ffn_size,
                            split=int((~pending[groups.expert]).sum()) if waits else None,
                            between=wait_for_copies if waits else None,
                            weights=self._weights(placed.layer))

    def graphed(self, layer: int, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor,
                addresses: torch.Tensor) -> torch.Tensor:
        """Inside a CUDA graph: top_idx, top_w [T, K] on the device, each expert read at its
        entry of `addresses` [E] (the cache's table row of the layer)."""
        f = self.format.at(layer)
        return self.gpu.moe_device(x, top_idx, top_w, addresses, f.ffn_size,
                                   weights=self._weights(layer))

    def _weights(self, layer: int):  # -> gpu_moe.Weights
        """What the kernels read `layer`'s blobs as (made once per layer)."""
        if layer not in self._by_layer:
            self._by_layer[layer] = self.gpu.Weights.of(self.format.at(layer))
        return self._by_layer[layer]


class TorchMoe:
    kind = "torch"

    def __init__(self, fmt: ExpertFormat):
        self.format = fmt

    def __call__(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor,
                 placed: Placed) -> torch.Tensor:
        assert placed.counts is not None
        K = top_idx.shape[1]
        order = torch.argsort(top_idx.flatten(), stable=True).to(x.device)  # [T*K] by expert
        token_of = order // K  # [T*K]
        weight_of = top_w.flatten()[order]  # [T*K]
        xs = x[token_of]  # [T*K, D], rows grouped by expert: one gather in
        ys = torch.empty_like(xs)  # [T*K, D]
        start, fmt = 0, self.format.at(placed.layer)
        for expert, n in enumerate(placed.counts.tolist()):
            if n:
                ys[start:start + n] = self._expert(fmt, x.device, xs[start:start + n],
                                                   placed.blobs[expert],
                                                   placed.ready.get(expert))
                start += n
        # One scatter-add out: index_add_ walks the rows in order, so each token still sums
        # its experts by ascending id.
        return torch.zeros_like(x).index_add_(0, token_of, ys * weight_of[:, None])  # [T, D]

    @staticmethod
    def _expert(fmt: ExpertFormat, device: torch.device, x: torch.Tensor, blob: torch.Tensor,
                ready: torch.cuda.Event | None) -> torch.Tensor:
        if ready is not None:
            torch.cuda.current_stream(device).wait_event(ready)
        if blob.device == x.device:
            return fmt.forward(x, blob)
        # a host blob on a CUDA engine: the CPU computes it (last bits may differ)
        return fmt.forward(x.cpu(), blob).to(x.device, non_blocking=True)


MoeCompute = CpuMoe | TritonMoe | TorchMoe


def moe_compute(fmt: ExpertFormat, device: torch.device, num_experts: int,
                cpu_kernels: CpuKernels | None) -> MoeCompute:
    """What computes a layer's routed experts for this format on this device."""
    if device.type == "cuda":
        gpu = device_kernel(fmt, device)
        if gpu is not None:
            return TritonMoe(gpu, fmt, num_experts, device)
    elif cpu_kernels is not None and fmt.kernel_weights in cpu_kernels.MOE_WEIGHTS:
        return CpuMoe(cpu_kernels, fmt, num_experts)
    return TorchMoe(fmt)
