"""One expert's weights as one flat blob: the layout shared by the host store and the slots.

Shape legend: T tokens, D hidden, F expert FFN, S work units of the down product (2).

A blob keeps the checkpoint's orientation, [out, in], as every weight of the engine does
(dense weights are [out, in] tensors too):

    blob = [ gate (F x D) | up (F x D) | down (D x F) ]          numel = 3*D*F

the orientation the GGUF block types and FP8 blobs (cache/formats.py) are stored in as well.
Each output is the dot product of the input with one contiguous weight row, so the CPU
kernels (strata_moe) stream each matrix as one sequential read, at the memory's full rate
(docs/benchmarks.md, "Weights as the checkpoint stores them"). Small experts on the CPU are
kept *inputs-major*, each matrix transposed ([in, out]):

    blob = [ gate^T (D x F) | up^T (D x F) | down^T (F x D) ]

where the C kernel multiplies each input into a register tile of outputs with no lane sums
(cache/formats.py's inputs_major says when). Hit and miss paths both run
`expert_swiglu` on views of a blob (the torch reference, kernels/backend.py's TorchBackend),
so their results are bit-identical on the same device; the C and Triton MoE kernels read the
same bytes by address.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

NUM_SPLITS = 2  # S: the down product's work units (its output rows in S parts), one per core
# of the dev CPU


def num_splits(num_rows: int) -> int:
    return NUM_SPLITS if num_rows % NUM_SPLITS == 0 else 1


@dataclass(frozen=True)
class ExpertLayout:
    hidden_size: int  # D
    ffn_size: int  # F
    inputs_major: bool = False  # each matrix stored [in, out] (the default: [out, in])

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
        biases, cache/formats.py): what forward runs. Inputs-major, they are strided views of
        the transposed matrices (writing them writes the blob)."""
        D, Fs = self.hidden_size, self.ffn_size
        split = 2 * D * Fs
        if self.inputs_major:
            return (blob[:split].view(2, D, Fs).transpose(1, 2),
                    blob[split:self.numel].view(Fs, D).t())
        return blob[:split].view(2, Fs, D), blob[split:self.numel].view(D, Fs)

    def views(self, blob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The logical weights (gate_up_t [D, 2F], down_t [F, D]) of a blob, as copies."""
        gate_up, down = self.parts(blob)
        return torch.cat([gate_up[0], gate_up[1]]).t().contiguous(), down.t().contiguous()

    def forward(self, x: torch.Tensor, blob: torch.Tensor) -> torch.Tensor:
        """One expert on its tokens: x [T, D] -> [T, D] (unweighted), in the blob's dtype."""
        return expert_swiglu(x.to(blob.dtype), *self.parts(blob)).to(x.dtype)


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
