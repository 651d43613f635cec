"""Quantized experts: weight-only symmetric int8 and int4 with group-wise scales, one flat byte
blob per pair (the slot), dequantized inside the expert matmul on whichever device runs it.

Shape legend: T tokens, D hidden, F expert FFN, S column splits (split_columns), B matrices
quantized together (gate and up; or the S down splits), K input rows, N output columns, G rows
per scale group.

    W_t [K, N] ~= q [K, N] * scales [K/G, N]    (a scale covers G consecutive input rows of one
    q = round(W_t / scale) in [-Q, Q]            output column; Q = 2**(bits-1) - 1, 0 stays 0)

int8  one byte per weight; one scale per output column (G = K): the scale factors out of every
      dot product and multiplies the matmul's output, so dequantizing is a plain int -> float copy.
int4  two weights per byte, offset-binary (q + 8): byte [r, n] holds row r in its low nibble and
      row r + K/2 in its high nibble, so unpacking writes two contiguous halves; groups of 32
      rows with fp16 scales: 4.5 bits per weight (llama.cpp's Q4_0 budget).

A pair's blob is uint8, each section 64-byte aligned (the int4 unpack reads 4-byte words):

    [ gate_up q [2, D', F] | gate_up scales [2, D/G, F] | down q [S, F', D/S] | down scales ]

(D' = D for int8, D/2 for int4.) The host store, the slots and the staging buffers hold these
bytes and every placement runs the same dequantize-then-matmul on them, so outputs never depend
on where a pair lives (exact within one expert dtype). The matmul dequantizes into scratch
buffers kept per device (no allocation per call beyond the products themselves) and works on all
B matrices of an expert in one op each; `dequantize` takes any leading batch, e.g. a stack of
experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.engine.cache.layout import num_splits

EXPERT_DTYPES = ("auto", "int8", "int4")  # auto: the engine's compute dtype, not quantized
ALIGN_BYTES = 64
NIBBLE_MASK = 0x0F0F0F0F  # the low nibble of each byte of a 4-byte word


def split_columns(w_t: torch.Tensor) -> torch.Tensor:
    """A pre-transposed weight [K, N] as S contiguous column blocks [S, K, N/S]."""
    K, N = w_t.shape
    S = num_splits(N)
    return w_t.reshape(K, S, N // S).transpose(0, 1).contiguous()


def join_columns(w: torch.Tensor) -> torch.Tensor:
    """The inverse of split_columns: [S, K, N/S] -> [K, N] (a copy)."""
    S, K, n = w.shape
    return w.transpose(0, 1).reshape(K, S * n)


@dataclass(frozen=True)
class QuantSpec:
    name: str
    bits: int  # 8 or 4
    group_size: int  # input rows per scale; 0: one scale per output column (the whole input)
    scale_dtype: torch.dtype

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def group(self, num_rows: int) -> int:
        """G for a matrix of num_rows input rows (a divisor of it)."""
        return num_rows if self.group_size == 0 else math.gcd(self.group_size, num_rows)


QUANT_SPECS = {
    "int8": QuantSpec("int8", 8, 0, torch.float32),
    "int4": QuantSpec("int4", 4, 32, torch.float16),
}


def quantize(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K, N] -> (q [..., K, N] int8 in [-Q, Q], scales [..., K/G, N] in the spec's
    scale dtype). q is rounded against the stored (possibly fp16) scale, not the exact one."""
    *lead, K, N = w.shape
    G = spec.group(K)
    groups = w.float().reshape(*lead, K // G, G, N)  # [..., K/G, G, N]
    absmax = groups.abs().amax(dim=-2)  # [..., K/G, N]
    tiny = torch.finfo(spec.scale_dtype).tiny  # all-zero groups: any positive scale gives q = 0
    scales = (absmax / spec.qmax).clamp(min=tiny).to(spec.scale_dtype)
    q = torch.round(groups / scales.float().unsqueeze(-2)).clamp(-spec.qmax, spec.qmax)
    return q.to(torch.int8).reshape(*lead, K, N), scales


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [..., K, N] int8 in [-7, 7] -> bytes [..., K/2, N]: row r low nibble, r + K/2 high."""
    K = q.shape[-2]
    assert K % 2 == 0, f"int4 packs pairs of rows: {K} rows"
    u = (q.to(torch.int16) + 8).to(torch.uint8)  # offset-binary 1..15
    return u[..., : K // 2, :] | (u[..., K // 2 :, :] << 4)


def unpack_int4(packed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """packed [..., K/2, N] uint8 -> out [..., K, N] uint8 nibbles 0..15 (offset-binary).
    The low nibbles are masked 4 bytes at a time when the layout allows (each matrix's bytes
    contiguous and 4-byte aligned, as in a blob or a stack of blobs)."""
    *lead, half, N = packed.shape
    words = half * N
    word_strides = all(st % 4 == 0 for st in packed.stride()[:-2])
    aligned = packed.storage_offset() % 4 == 0 and out.storage_offset() % 4 == 0
    if (
        words % 4 == 0
        and aligned
        and word_strides
        and packed.stride()[-2:] == (N, 1)
        and out.is_contiguous()
    ):
        src = packed.flatten(-2).view(torch.int32)  # [..., K/2 * N / 4]
        dst = out.reshape(*lead, 2, words).view(torch.int32)  # [..., 2, K/2 * N / 4]
        torch.bitwise_and(src, NIBBLE_MASK, out=dst[..., 0, :])
    else:
        torch.bitwise_and(packed, 0x0F, out=out[..., :half, :])
    torch.bitwise_right_shift(packed, 4, out=out[..., half:, :])  # uint8: a logical shift
    return out


def _aligned(num_bytes: int) -> int:
    return -(-num_bytes // ALIGN_BYTES) * ALIGN_BYTES


@dataclass
class _Scratch:
    """Per (device, dtype) buffers of one matrix batch: dequantized weights, nibbles, scales."""

    weights: torch.Tensor  # [B, K, N] compute dtype
    nibbles: torch.Tensor | None  # [B, K, N] uint8 (int4)
    scales: torch.Tensor | None  # [B, K/G, N] compute dtype (when the stored dtype differs)


class QuantMatrices:
    """B matrices [K, N] quantized together: their byte size, packing, dequantize and matmul."""

    def __init__(self, spec: QuantSpec, B: int, K: int, N: int):
        if spec.bits == 4 and K % 2:
            raise ValueError(f"int4 experts need even matrix sizes, got {K} input rows")
        self.spec, self.B, self.K, self.N = spec, B, K, N
        self.G = spec.group(K)
        self.q_rows = K // 2 if spec.bits == 4 else K
        self.q_bytes = B * self.q_rows * N
        self.scale_shape = (B, K // self.G, N)
        self.scale_bytes = math.prod(self.scale_shape) * spec.scale_dtype.itemsize
        self.nbytes = _aligned(self.q_bytes) + _aligned(self.scale_bytes)

    def parts(self, blob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [..., B, K', N] int8 or packed uint8, scales [..., B, K/G, N]) views of `blob`
        [..., nbytes] (one blob, or a stack of them)."""
        lead = blob.shape[:-1]
        q = blob[..., : self.q_bytes].view(*lead, self.B, self.q_rows, self.N)
        if self.spec.bits == 8:
            q = q.view(torch.int8)
        start = _aligned(self.q_bytes)
        scales = blob[..., start : start + self.scale_bytes].view(self.spec.scale_dtype)
        return q, scales.view(*lead, *self.scale_shape)

    def pack(self, w: torch.Tensor, out: torch.Tensor) -> None:
        """Quantize w [B, K, N] into the byte view `out` [nbytes]."""
        assert w.shape == (self.B, self.K, self.N), w.shape
        q, scales = quantize(w, self.spec)
        q_out, scales_out = self.parts(out)
        q_out.copy_(pack_int4(q) if self.spec.bits == 4 else q)
        scales_out.copy_(scales)

    def dequantize(
        self,
        blob: torch.Tensor,
        out: torch.Tensor,
        scratch: _Scratch | None = None,
        with_scales: bool = True,
    ) -> torch.Tensor:
        """The weights [..., B, K, N] of blob [..., nbytes] in out's dtype (with_scales=False:
        q alone, offset removed). Vectorized over any leading batch, e.g. a stack of experts."""
        q, scales = self.parts(blob)
        if self.spec.bits == 4:
            nibbles = scratch.nibbles if scratch is not None else None
            if nibbles is None:
                nibbles = torch.empty(out.shape, dtype=torch.uint8, device=out.device)
            # offset-binary 0..15 minus 8 fits int8: one op converts and removes the offset
            torch.sub(unpack_int4(q, nibbles).view(torch.int8), 8, out=out)
        else:
            out.copy_(q)
        if with_scales:
            *lead, B, K, N = out.shape
            groups = (*lead, B, K // self.G, self.G, N)
            s = self._scales_as(scales, out.dtype, scratch)
            out.view(groups).mul_(s.view(*lead, B, K // self.G, 1, N).expand(groups))
        return out

    def _scales_as(
        self, scales: torch.Tensor, dtype: torch.dtype, scratch: _Scratch | None
    ) -> torch.Tensor:
        """Scales in the compute dtype (a mixed-dtype multiply takes CPU's slow path)."""
        if scales.dtype == dtype:
            return scales
        if scratch is not None and scratch.scales is not None:
            return scratch.scales.copy_(scales)
        return scales.to(dtype)

    def matmul(self, x: torch.Tensor, blob: torch.Tensor, scratch: _Scratch) -> torch.Tensor:
        """x [T, K] times each of the B matrices -> [B, T, N] (x's dtype)."""
        T = x.shape[0]
        per_column = self.G == self.K  # one scale per column: it multiplies the output instead
        w = self.dequantize(blob, scratch.weights, scratch, with_scales=not per_column)
        y = torch.bmm(x.expand(self.B, T, self.K), w)  # [B, T, N]
        if per_column:
            y.mul_(self._scales_as(self.parts(blob)[1], y.dtype, scratch))  # [B, 1, N] over T
        return y

    def scratch(self, device: torch.device, dtype: torch.dtype) -> _Scratch:
        shape = (self.B, self.K, self.N)
        nibbles = (
            torch.empty(shape, dtype=torch.uint8, device=device) if self.spec.bits == 4 else None
        )
        scales = None
        if self.spec.scale_dtype != dtype:
            scales = torch.empty(self.scale_shape, dtype=dtype, device=device)
        return _Scratch(torch.empty(shape, dtype=dtype, device=device), nibbles, scales)


class QuantExpertLayout:
    """The quantized counterpart of cache.layout.ExpertLayout (same interface): a blob is
    `numel` bytes of uint8 whatever the compute dtype."""

    def __init__(self, hidden_size: int, ffn_size: int, spec: QuantSpec):
        D, Fs = hidden_size, ffn_size
        self.hidden_size, self.ffn_size, self.spec = D, Fs, spec
        self.splits = num_splits(D)
        self.gate_up = QuantMatrices(spec, 2, D, Fs)  # [2, D, F]: gate, up
        self.down = QuantMatrices(spec, self.splits, Fs, D // self.splits)  # [S, F, D/S]
        self.numel = self.gate_up.nbytes + self.down.nbytes
        self._scratch: dict[tuple[torch.device, torch.dtype], tuple[_Scratch, _Scratch]] = {}

    @property
    def name(self) -> str:
        return self.spec.name

    def describe(self) -> str:
        G = self.gate_up.G if self.spec.group_size else 0
        scales = "one scale per output column" if not G else f"groups of {G} input rows"
        return (
            f"{self.spec.name} ({scales}, {str(self.spec.scale_dtype).removeprefix('torch.')}"
            f" scales)"
        )

    def blob_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.uint8

    def blob_bytes(self, dtype: torch.dtype) -> int:
        """Exact bytes of one pair's blob (= one slot): the same for every compute dtype."""
        return self.numel

    def pack(
        self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, out: torch.Tensor
    ) -> None:
        """Quantize HF-oriented weights (gate/up [F, D], down [D, F]) into the byte blob `out`."""
        D, Fs = self.hidden_size, self.ffn_size
        assert gate.shape == up.shape == (Fs, D) and down.shape == (D, Fs), (gate.shape, down.shape)
        gu_bytes, down_bytes = self._sections(out)
        self.gate_up.pack(torch.stack([gate.t(), up.t()]), gu_bytes)  # [2, D, F]
        self.down.pack(split_columns(down.t()), down_bytes)  # [S, F, D/S]

    def dequantize_experts(
        self, blobs: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A stack of blobs [E, numel] -> (gate_up [E, 2, D, F], down [E, S, F, D/S]) in the
        split layout forward runs, a few ops for all E experts."""
        E, dev = blobs.shape[0], blobs.device
        gu_bytes, down_bytes = self._sections(blobs)
        gu, d = self.gate_up, self.down
        return (
            gu.dequantize(gu_bytes, torch.empty(E, gu.B, gu.K, gu.N, dtype=dtype, device=dev)),
            d.dequantize(down_bytes, torch.empty(E, d.B, d.K, d.N, dtype=dtype, device=dev)),
        )

    def views(
        self, blob: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The dequantized logical weights (gate_up_t [D, 2F], down_t [F, D]) of one blob."""
        [gu], [down] = self.dequantize_experts(blob[None], dtype)
        return torch.cat([gu[0], gu[1]], dim=1), join_columns(down)

    def forward(self, x: torch.Tensor, blob: torch.Tensor) -> torch.Tensor:
        """One expert on its tokens: x [T, D] -> [T, D] (unweighted), on blob's device."""
        gu_scratch, down_scratch = self.scratch(blob.device, x.dtype)
        gu_bytes, down_bytes = self._sections(blob)
        gu = self.gate_up.matmul(x, gu_bytes, gu_scratch)  # [2, T, F]
        h = F.silu(gu[0]) * gu[1]  # [T, F]
        y = self.down.matmul(h, down_bytes, down_scratch)  # [S, T, D/S]
        T, S = x.shape[0], self.splits
        return y[0] if S == 1 else y.transpose(0, 1).reshape(T, self.hidden_size)

    def scratch(self, device: torch.device, dtype: torch.dtype) -> tuple[_Scratch, _Scratch]:
        """Reused dequantization buffers for `device` (the engine's step loop is one thread;
        on CUDA, reuse is ordered by the compute stream)."""
        key = (device, dtype)
        if key not in self._scratch:
            self._scratch[key] = (
                self.gate_up.scratch(device, dtype),
                self.down.scratch(device, dtype),
            )
        return self._scratch[key]

    def _sections(self, blob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up bytes, down bytes) of blob [..., numel] (or more: biases after them)."""
        assert blob.dtype == torch.uint8 and blob.shape[-1] >= self.numel, (blob.dtype, blob.shape)
        return blob[..., : self.gate_up.nbytes], blob[..., self.gate_up.nbytes : self.numel]
