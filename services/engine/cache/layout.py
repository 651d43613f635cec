"""The two weight layouts of the engine: the dense weights' column splits, and one expert's
weights as one flat blob, shared by the host store and the slots.

Shape legend: T tokens, D hidden, F expert FFN, S column splits (2), K input rows, N output
columns.

Dense weights (attention, dense MLPs, lm_head) are pre-transposed ([in, out]) and stored as S
contiguous column blocks, [S, K, N/S] (`split_columns`), so each product is one `torch.bmm`
over S independent halves: on the CPU a single-row `x @ W` runs on one core (MKL's gemv at
about half the memory bandwidth), a batch of S halves on S cores near the bandwidth limit.
Every output element is still one dot product over the full input, so the results equal the
plain `x @ W_t`. The C (strata_linear) and Triton kernels read this layout too.

An expert's blob keeps the checkpoint's orientation, [out, in]:

    blob = [ gate (F x D) | up (F x D) | down (D x F) ]          numel = 3*D*F

the orientation the GGUF block types and FP8 blobs (cache/formats.py) are stored in as well.
Each output is the dot product of the input with one contiguous weight row, so the CPU
kernels (strata_moe) stream each matrix as one sequential read, at the memory's full rate
(docs/benchmarks.md, "Experts stored as the checkpoint stores them"). Hit and miss paths both
run `expert_swiglu` on views of a blob (the torch reference, kernels/backend.py's
TorchBackend), so their results are bit-identical on the same device; the C and Triton MoE
kernels read the same bytes by address.
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
        gate_up, down_w = self.parts(out)
        gate_up[0].copy_(gate)
        gate_up[1].copy_(up)
        down_w.copy_(down)

    def parts(self, blob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2, F, D], down [D, F]) views into a flat blob (whose tail may hold more:
        biases, cache/formats.py): what forward runs."""
        D, Fs = self.hidden_size, self.ffn_size
        split = 2 * D * Fs
        return blob[:split].view(2, Fs, D), blob[split:self.numel].view(D, Fs)

    def views(self, blob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The logical weights (gate_up_t [D, 2F], down_t [F, D]) of a blob, as copies."""
        gate_up, down = self.parts(blob)
        return torch.cat([gate_up[0], gate_up[1]]).t().contiguous(), down.t().contiguous()

    def forward(self, x: torch.Tensor, blob: torch.Tensor) -> torch.Tensor:
        """One expert on its tokens: x [T, D] -> [T, D] (unweighted), in the blob's dtype."""
        return expert_swiglu(x.to(blob.dtype), *self.parts(blob)).to(x.dtype)


def split_swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """A dense MLP in the split layout, down(silu(gate(x)) * up(x)): x [T, D], gate_up
    [2, D, F] (gate, up), down [S, F, D/S] -> [T, D]."""
    T, D = x.shape
    gu = torch.bmm(x.expand(2, T, D), gate_up)  # [2, T, F]: gate and up on one core each
    return matmul_split(F.silu(gu[0]) * gu[1], down)  # [T, D]


def expert_swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert, down(silu(gate(x)) * up(x)), on its blob's views: x [T, D], gate_up
    [2, F, D] (gate, up), down [D, F] -> [T, D]."""
    gate, up = F.linear(x, gate_up[0]), F.linear(x, gate_up[1])  # [T, F] each
    return F.linear(F.silu(gate) * up, down)


def swiglu(x: torch.Tensor, gate_up_t: torch.Tensor, down_t: torch.Tensor) -> torch.Tensor:
    """expert_swiglu on logical weights (gate_up_t [D, 2F], down_t [F, D]): x [T, D] -> [T, D]."""
    Fs = gate_up_t.shape[1] // 2
    gate_up = torch.stack([gate_up_t[:, :Fs].t(), gate_up_t[:, Fs:].t()]).contiguous()
    return expert_swiglu(x, gate_up, down_t.t().contiguous())
