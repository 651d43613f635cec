"""Expert formats: what one pair's blob is, and what computes on it.

Shape legend: n tokens routed to one expert, D hidden, F expert FFN.

Every part of the cache deals in blobs of one format — the host store's rows, the slots, the
staging copies and the link carry `blob_bytes` each — and asks the format, never a type test,
what it may do with them:

    ExpertFormat          name, dtype (a blob's elements), numel, blob_bytes, describe()
      pack(gate, up, down, out)   a pair's checkpoint tensors -> its blob
      forward(x, blob)            one expert on its rows, torch ops on the blob's device (the
                                  reference; the per-expert path where no kernel applies)
      kernel_weight_dtype         the dtype the address-reading kernels take these blobs as
                                  (the C strata_moe on the CPU, the Triton gpu_moe on CUDA), or
                                  None: the cache runs forward() per expert
      exact_on(device, kernel)    whether a hit, a miss read in place and a staged copy give
                                  the same bits there

    DenseFormat     fp32 or bf16 weights in cache/layout.py's split layout
    QuantFormat     int8 / int4 weight-only quantization (model/quant.py), bytes

A new format (a GGUF block type, FP8 with block scales) is one more class with these members.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Protocol

import torch

from services.engine.cache.layout import ExpertLayout
from services.engine.model.dtypes import dtype_name
from services.engine.model.quant import EXPERT_DTYPES, QUANT_SPECS, QuantExpertLayout

log = logging.getLogger("strata.engine")


class ExpertFormat(Protocol):
    name: str  # "fp32", "bf16", "int8", "int4"
    hidden_size: int  # D
    ffn_size: int  # F
    dtype: torch.dtype  # a blob's element type
    numel: int  # elements per blob
    read_dtype: torch.dtype  # what the checkpoint's expert tensors are read in for pack()

    @property
    def blob_bytes(self) -> int:
        """Bytes of one pair's blob: one slot, one copy over the link."""
        ...

    @property
    def kernel_weight_dtype(self) -> torch.dtype | None:
        """The weight dtype the address-reading MoE kernels take these blobs as, or None."""
        ...

    def describe(self) -> str: ...

    def pack(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
             out: torch.Tensor) -> None:
        """HF-oriented weights (gate/up [F, D], down [D, F]) into the blob `out`."""
        ...

    def forward(self, x: torch.Tensor, blob: torch.Tensor) -> torch.Tensor:
        """One expert on its tokens: x [n, D] -> [n, D] (unweighted), in x's dtype."""
        ...


class _Common:
    """What every format shares: its byte layout (`layout`) packs, computes and unpacks."""

    name: str
    hidden_size: int
    ffn_size: int
    dtype: torch.dtype
    numel: int
    layout: ExpertLayout | QuantExpertLayout

    def pack(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
             out: torch.Tensor) -> None:
        self.layout.pack(gate, up, down, out)

    def forward(self, x: torch.Tensor, blob: torch.Tensor) -> torch.Tensor:
        return self.layout.forward(x, blob)

    def views(self, blob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The logical weights (gate_up_t [D, 2F], down_t [F, D]) of a blob, as copies."""
        return self.layout.views(blob)

    @property
    def blob_bytes(self) -> int:
        return self.numel * self.dtype.itemsize

    kernel_weight_dtype: torch.dtype | None = None

    def exact_on(self, device: torch.device, kernel: bool) -> bool:
        """Whether every placement gives a hit's bits on `device`: on the CPU the same code
        reads the same bytes wherever they lie; on CUDA only when the device kernel reads a
        miss in place (otherwise the CPU computes it, in other kernels)."""
        return device.type != "cuda" or kernel


class DenseFormat(_Common):
    """Unquantized weights (fp32 or bf16) in the split layout of cache/layout.py."""

    def __init__(self, hidden_size: int, ffn_size: int, dtype: torch.dtype):
        assert dtype in (torch.float32, torch.bfloat16), dtype
        self.layout = ExpertLayout(hidden_size, ffn_size)
        self.hidden_size, self.ffn_size, self.dtype = hidden_size, ffn_size, dtype
        self.name = dtype_name(dtype)
        self.numel = self.layout.numel
        self.read_dtype = dtype
        self.kernel_weight_dtype = dtype

    def describe(self) -> str:
        return f"{self.name} (unquantized)"



class QuantFormat(_Common):
    """Weight-only int8 / int4 (model/quant.py): a blob is bytes, dequantized inside the
    expert product to the activations' dtype; run per expert as torch ops."""

    def __init__(self, hidden_size: int, ffn_size: int, expert_dtype: str):
        self.layout = QuantExpertLayout(hidden_size, ffn_size, QUANT_SPECS[expert_dtype])
        self.hidden_size, self.ffn_size = hidden_size, ffn_size
        self.name, self.dtype, self.numel = expert_dtype, torch.uint8, self.layout.numel
        self.read_dtype = torch.float32  # quantized from the exact weights

    def describe(self) -> str:
        return self.layout.describe()



def expert_format(hidden_size: int, ffn_size: int, dtype: torch.dtype,
                  expert_dtype: str = "auto") -> DenseFormat | QuantFormat:
    """The format of `--expert-dtype` for weights served in `dtype`: auto keeps the weights
    as they are (fp32 or bf16), int8 / int4 quantize them."""
    if expert_dtype == "auto":
        return DenseFormat(hidden_size, ffn_size, dtype)
    if expert_dtype not in QUANT_SPECS:
        raise ValueError(f"unknown expert dtype {expert_dtype!r} (choose from {EXPERT_DTYPES})")
    return QuantFormat(hidden_size, ffn_size, expert_dtype)


def device_kernel(fmt: ExpertFormat, device: torch.device) -> ModuleType | None:
    """The Triton MoE kernels when they run these experts (a format they take, on a CUDA
    device, Triton installed), else None."""
    if device.type != "cuda" or fmt.kernel_weight_dtype is None:
        return None
    try:
        from services.engine.kernels import gpu_moe
    except ImportError as e:
        log.warning("Triton is not importable (%s): routed experts run as torch ops per expert "
                    "and host-placed misses on the CPU; install triton for the device kernel", e)
        return None
    return gpu_moe
