"""GGUF block types kept as stored: their reference dequantization, and BlockMatrix, a dense
weight held in its block type (cache/formats.py's BlockFormat holds experts the same way).

Q8_0: blocks of 32 weights, each an fp16 scale d then 32 int8 quants q; weight = d * q.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Q8_0_WEIGHTS, Q8_0_BYTES = 32, 34  # per block


def dequantize_q8_0(data: torch.Tensor) -> torch.Tensor:
    """Q8_0 bytes -> fp32 weights: each block is an fp16 scale d and 32 int8 quants q;
    weight = d * q (exact in fp32; gguf-py's dequantize gives the same bits)."""
    blocks = data.reshape(-1, Q8_0_BYTES)  # [n, 34]
    d = blocks[:, :2].contiguous().view(torch.float16).float()  # [n, 1]
    q = blocks[:, 2:].contiguous().view(torch.int8).float()  # [n, 32]
    return (d * q).reshape(-1)


@dataclass
class BlockMatrix:
    """A dense weight kept in its GGUF block type (an lm_head stored as Q8_0): N rows of K
    weights, `blocks` [N, row bytes] as the file stores them. Backends with a kernel for it
    read it as it is (CpuBackend: strata_linear_q8_0); `dequantize` is the reference."""

    blocks: torch.Tensor  # uint8 [N, K / 32 * 34]
    in_features: int  # K
    block_type: str = "Q8_0"

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in dtype."""
        return dequantize_q8_0(self.blocks).view(self.out_features, self.in_features).to(dtype)
