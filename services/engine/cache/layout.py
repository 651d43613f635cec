"""One expert's weights as one flat blob: the single layout shared by the host store and the slots.

Shape legend: T tokens, D hidden, F expert FFN, S column splits (2), N output columns.

    blob = [ gate_t (D x F) | up_t (D x F) | down_t split by columns: S x (F x D/S) ]
                                                                           numel = 3*D*F

Weights are pre-transposed ([in, out]) and stored as S contiguous column blocks, so each product
is one `torch.bmm` over S independent halves. On the CPU a single-row `x @ W` runs on one core
(MKL's gemv at about half the memory bandwidth); a batch of S halves runs on S cores and reads
the weights near the bandwidth limit. Every output element is still one dot product over the
full input, so the results equal the plain `x @ W_t` (bit-identical on the dev CPU but for some
small-T MKL kernel choices). Hit and miss paths both run `split_swiglu` on views of a blob in
this layout, so their results are bit-identical on the same device.

The functions here are the torch reference of these products (kernels/backend.py's
TorchBackend); the C kernels (a whole MoE layer in strata_moe, dense products in strata_linear)
and the Triton kernels read this same layout: each column block is a contiguous [in, out/S]
matrix streamed row by row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

NUM_SPLITS = 2  # S: one column block per core of the dev CPU


def num_splits(num_columns: int) -> int:
    return NUM_SPLITS if num_columns % NUM_SPLITS == 0 else 1


def split_columns(w_t: torch.Tensor) -> torch.Tensor:
    """A pre-transposed weight [K, N] as S contiguous column blocks [S, K, N/S]."""
    K, N = w_t.shape
    S = num_splits(N)
    return w_t.reshape(K, S, N // S).transpose(0, 1).contiguous()


def join_columns(w: torch.Tensor) -> torch.Tensor:
    """The inverse of split_columns: [S, K, N/S] -> [K, N] (a copy)."""
    S, K, n = w.shape
    return w.transpose(0, 1).reshape(K, S * n)


def matmul_split(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ the split weight w [S, K, N/S] -> [T, N] in one torch.bmm."""
    S, K, n = w.shape
    T = x.shape[0]
    y = torch.bmm(x.expand(S, T, K), w)  # [S, T, N/S]
    return y[0] if S == 1 else y.transpose(0, 1).reshape(T, S * n)


@dataclass(frozen=True)
class ExpertLayout:
    hidden_size: int  # D
    ffn_size: int  # F

    @property
    def numel(self) -> int:
        return 3 * self.hidden_size * self.ffn_size

    def blob_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """Element type of a blob whose weights compute in `dtype`: `dtype` itself (the
        quantized layout, services.engine.model.quant, stores bytes)."""
        return dtype

    def blob_bytes(self, dtype: torch.dtype) -> int:
        """Exact byte size of one pair's blob (= one slot) in `dtype`."""
        return self.numel * dtype.itemsize

    def pack(
        self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, out: torch.Tensor
    ) -> None:
        """Write HF-oriented weights (gate/up [F, D], down [D, F]) into the flat blob `out`."""
        D, Fs = self.hidden_size, self.ffn_size
        assert gate.shape == up.shape == (Fs, D) and down.shape == (D, Fs), (gate.shape, down.shape)
        gate_up, down_split = self.parts(out)
        gate_up[0].copy_(gate.t())  # [D, F]
        gate_up[1].copy_(up.t())  # [D, F]
        down_split.copy_(split_columns(down.t()))  # [S, F, D/S]

    def parts(self, blob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2, D, F], down [S, F, D/S]) views into a flat blob (whose tail may hold
        more: biases, cache/formats.py): what forward runs."""
        D, Fs = self.hidden_size, self.ffn_size
        split, S = 2 * D * Fs, num_splits(D)
        return blob[:split].view(2, D, Fs), blob[split:self.numel].view(S, Fs, D // S)

    def views(self, blob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The logical weights (gate_up_t [D, 2F], down_t [F, D]) of a blob, as copies."""
        gate_up, down = self.parts(blob)
        return torch.cat([gate_up[0], gate_up[1]], dim=1), join_columns(down)

    def forward(self, x: torch.Tensor, blob: torch.Tensor) -> torch.Tensor:
        """One expert on its tokens: x [T, D] -> [T, D] (unweighted), in the blob's dtype."""
        return split_swiglu(x.to(blob.dtype), *self.parts(blob)).to(x.dtype)


def split_swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)): x [T, D], gate_up [2, D, F] (gate, up), down [S, F, D/S]
    -> [T, D]."""
    T, D = x.shape
    gu = torch.bmm(x.expand(2, T, D), gate_up)  # [2, T, F]: gate and up on one core each
    return matmul_split(F.silu(gu[0]) * gu[1], down)  # [T, D]


def swiglu(x: torch.Tensor, gate_up_t: torch.Tensor, down_t: torch.Tensor) -> torch.Tensor:
    """split_swiglu on logical weights (gate_up_t [D, 2F], down_t [F, D]): x [T, D] -> [T, D]."""
    D, two_f = gate_up_t.shape
    gate_up = gate_up_t.view(D, 2, two_f // 2).transpose(0, 1).contiguous()  # [2, D, F]
    return split_swiglu(x, gate_up, split_columns(down_t))
