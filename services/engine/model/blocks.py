"""GGUF block types kept as stored: their layouts, their reference dequantization, and
BlockMatrix, a dense weight held in its block types (cache/formats.py's BlockFormat holds
experts the same way; kernels/cpu_kernels.c's product_blocks computes on both).

A row of `in` weights is in / W blocks of B bytes, in order. Per block (ggml's definitions;
each dequantization below gives gguf-py's `dequantize` bits, tests/engine/test_block_kernels):

    Q8_0   W 32,  B 34:  fp16 d, int8 q[32]                          w = d * q
    Q4_0   W 32,  B 18:  fp16 d, 16 bytes: weight j low nibble,      w = d * (q - 8)
                         weight j + 16 high nibble
    Q2_K   W 256, B 84:  scales[16] (low 4 bits scale, high 4 min),  w = d * s_g * q - dmin * m_g
                         2-bit q[64 bytes], fp16 d, fp16 dmin
    Q3_K   W 256, B 110: high bits[32], 2-bit low q[64], 12 bytes of w = d * s_g * (q - 4)
                         16 6-bit scales (stored + 32), fp16 d
    Q4_K   W 256, B 144: fp16 d, fp16 dmin, 12 bytes of 8 6-bit      w = d * s * q - dmin * m
                         scales and mins, 4-bit q[128]               (per 32-weight sub-block)
    Q5_K   W 256, B 176: as Q4_K, then high bits[32] before q[128]
    Q6_K   W 256, B 210: low 4 bits[128], high 2 bits[64], int8      w = d * s_g * (q - 32)
                         scales[16], fp16 d
    IQ4_NL W 32,  B 18:  fp16 d, 16 bytes of 4-bit indices (as Q4_0) w = d * IQ4[q]
    MXFP4  W 32,  B 17:  E8M0 exponent e, 16 bytes of indices        w = 2^(e - 128) * FP4[q]
    IQ4_XS W 256, B 136: fp16 d, uint16 high scale bits, 4 bytes of  w = d * (s - 32) * IQ4[q]
                         low scale nibbles, 128 bytes of indices     (per 32-weight sub-block,
                                                                     its 16 bytes as IQ4_NL's)

g is a weight's group of 16 within its super-block. The K-quants lay a super-block out in
chunks of 32 weights (chunk c = weights 32c .. 32c + 31): Q4_K/Q5_K chunk c is the low (even c)
or high (odd c) nibbles of quant bytes 32 (c // 2) ..; Q6_K chunk c of half n = c // 4 takes
low bytes 64 n + 32 (c % 2) .. (low nibbles for c % 4 < 2, else high) and high-bit pair c % 4
of bytes 32 n ..; Q2_K / Q3_K chunk c takes bit pair c % 4 of quant bytes 32 (c // 4) .. (and
Q3_K high bit c // 4 * 4 + c % 4 of each of its 32 high-bit bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class BlockType:
    name: str  # GGUF type name
    weights: int  # per block
    bytes: int  # per block
    kernel: int  # cpu_kernels.c's WT_* code

    def row_bytes(self, in_features: int) -> int:
        return in_features // self.weights * self.bytes

    @property
    def bits(self) -> float:
        """Bits per weight."""
        return 8 * self.bytes / self.weights


BLOCK_TYPES = {t.name: t for t in (
    BlockType("Q8_0", 32, 34, 2), BlockType("Q4_0", 32, 18, 3), BlockType("Q2_K", 256, 84, 4),
    BlockType("Q3_K", 256, 110, 5), BlockType("Q4_K", 256, 144, 6),
    BlockType("Q5_K", 256, 176, 7), BlockType("Q6_K", 256, 210, 8),
    BlockType("IQ4_NL", 32, 18, 9), BlockType("MXFP4", 32, 17, 10),
    BlockType("IQ4_XS", 256, 136, 11))}

FP8_STORED = "FP8_E4M3"  # an FP8 checkpoint's expert type (CheckpointReader.expert_storage)

IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
FP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # E2M1, doubled


def block_type(name: str) -> BlockType:
    if name not in BLOCK_TYPES:
        raise ValueError(f"GGUF block type {name} is not computed as stored (supported: "
                         f"{', '.join(BLOCK_TYPES)})")
    return BLOCK_TYPES[name]


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """[n, 1] fp32 of the fp16 at byte `at` of each block."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _bit_pairs(q: torch.Tensor) -> torch.Tensor:
    """[n, 32] bytes -> [n, 4, 32]: bit pair j of every byte, j = 0..3."""
    return torch.stack([(q >> (2 * j)) & 3 for j in range(4)], dim=1)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * b[:, 2:].contiguous().view(torch.int8).float()


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = b[:, 2:18]
    return _f16(b, 0) * (torch.cat([q & 15, q >> 4], dim=1).float() - 8)


def _scale_min_k4(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 scale bytes -> (scales [n, 8], mins [n, 8]), 6 bits each."""
    sc = sc.long()
    lo_s, lo_m = sc[:, 0:4] & 63, sc[:, 4:8] & 63
    hi_s = (sc[:, 8:12] & 15) | ((sc[:, 0:4] >> 6) << 4)
    hi_m = (sc[:, 8:12] >> 4) | ((sc[:, 4:8] >> 6) << 4)
    return torch.cat([lo_s, hi_s], 1).float(), torch.cat([lo_m, hi_m], 1).float()


def _nibble_chunks(qs: torch.Tensor) -> torch.Tensor:
    """[n, 128] bytes -> [n, 8, 32]: chunk c = low (even c) / high (odd c) nibbles of 32 (c//2).."""
    q = qs.reshape(-1, 4, 1, 32)
    return torch.cat([q & 15, q >> 4], dim=2).reshape(-1, 8, 32)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(b, 0), _f16(b, 2)
    s, m = _scale_min_k4(b[:, 4:16])
    q = _nibble_chunks(b[:, 16:144]).float()
    return ((d * s)[..., None] * q - (dmin * m)[..., None]).reshape(-1, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(b, 0), _f16(b, 2)
    s, m = _scale_min_k4(b[:, 4:16])
    qh = b[:, 16:48]
    high = torch.stack([(qh >> c) & 1 for c in range(8)], dim=1)  # [n, 8, 32]
    q = (_nibble_chunks(b[:, 48:176]) | (high << 4)).float()
    return ((d * s)[..., None] * q - (dmin * m)[..., None]).reshape(-1, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 208)
    s = b[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16]
    halves = []
    for n in range(2):
        ql, qh = b[:, 64 * n:64 * n + 64], b[:, 128 + 32 * n:160 + 32 * n]
        low = torch.stack([ql[:, :32] & 15, ql[:, 32:] & 15, ql[:, :32] >> 4, ql[:, 32:] >> 4],
                          dim=1)  # [n, 4, 32]
        halves.append(low | (_bit_pairs(qh) << 4))
    q = torch.cat(halves, dim=1).reshape(-1, 16, 16).float() - 32  # [n, groups, 16]
    return ((d * s)[..., None] * q).reshape(-1, 256)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(b, 80), _f16(b, 82)
    sc = b[:, :16]
    q = torch.cat([_bit_pairs(b[:, 16 + 32 * n:48 + 32 * n]) for n in range(2)], dim=1)
    q = q.reshape(-1, 16, 16).float()
    return ((d * (sc & 15).float())[..., None] * q
            - (dmin * (sc >> 4).float())[..., None]).reshape(-1, 256)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 108)
    sc = b[:, 96:108].long()
    lo = torch.cat([sc[:, :8] & 15, sc[:, :8] >> 4], dim=1)  # [n, 16]
    hi = torch.cat([(sc[:, 8:12] >> (2 * k)) & 3 for k in range(4)], dim=1)
    s = ((lo | (hi << 4)) - 32).float()
    hm = b[:, :32]
    q = torch.cat([_bit_pairs(b[:, 32 + 32 * n:64 + 32 * n])
                   | (torch.stack([(hm >> (4 * n + j)) & 1 for j in range(4)], dim=1) << 2)
                   for n in range(2)], dim=1)  # [n, 8, 32]
    q = q.reshape(-1, 16, 16).float() - 4
    return ((d * s)[..., None] * q).reshape(-1, 256)


def _table(q: torch.Tensor, values: tuple[int, ...]) -> torch.Tensor:
    """16 bytes of indices per row -> [n, 32] table values (low nibbles first)."""
    table = torch.tensor(values, dtype=torch.float32, device=q.device)
    return table[torch.cat([q & 15, q >> 4], dim=1).long()]


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _table(b[:, 2:18], IQ4_VALUES)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    e = b[:, :1].long()  # 2^(e - 128): ggml's e8m0_to_fp32_half, exact (e = 0 is 2^-128)
    d = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e - 128)
    return d * _table(b[:, 1:17], FP4_VALUES)


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    high = b[:, 2:4].contiguous().view(torch.int16).long() & 0xFFFF  # [n, 1]
    low = b[:, 4:8].long()
    k = torch.arange(8, device=b.device)
    ls = ((low[:, k // 2] >> (4 * (k % 2))) & 15) | (((high >> (2 * k)) & 3) << 4)  # [n, 8]
    dl = d * (ls - 32).float()  # [n, 8]
    q = torch.stack([_table(b[:, 8 + 16 * j:24 + 16 * j], IQ4_VALUES) for j in range(8)], 1)
    return (dl[..., None] * q).reshape(-1, 256)


_DEQUANTIZE = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k,
               "Q5_K": _q5_k, "Q6_K": _q6_k, "IQ4_NL": _iq4_nl, "MXFP4": _mxfp4,
               "IQ4_XS": _iq4_xs}


def mxfp4_from_openai(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Rows in OpenAI's MXFP4 layout (gpt-oss's safetensors: `*_blocks` uint8 [R, n, 16],
    weight 2j of a block in byte j's low nibble and 2j + 1 in its high one; `*_scales` uint8
    [R, n], the same E8M0 exponents) as GGUF MXFP4 rows [R, n * 17]: each block's exponent,
    then weight j in byte j's low nibble and j + 16 in its high one. Every bit is kept."""
    lo, hi = blocks & 0x0F, blocks >> 4  # [R, n, 16]
    w = np.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], 32)  # weight order
    out = np.empty((*blocks.shape[:-1], 17), dtype=np.uint8)
    out[..., 0] = scales
    out[..., 1:] = w[..., :16] | (w[..., 16:] << 4)
    return out.reshape(blocks.shape[0], -1)


def dequantize(data: torch.Tensor, type_name: str) -> torch.Tensor:
    """Bytes of whole blocks of a block type (any shape, uint8) -> fp32 weights [n], on the
    data's device."""
    t = block_type(type_name)
    return _DEQUANTIZE[t.name](data.reshape(-1, t.bytes)).reshape(-1)


def round_activations(x: torch.Tensor, type_name: str) -> torch.Tensor:
    """x [..., K] (fp32) as the CPU kernels' integer products see it against weights of this
    block type: per block of the type's size (32 or 256 values) a scale d = max|x| / 127 and
    q = x * (127 / max|x|) rounded to nearest even; returns d * q (fp32). The product of the
    result with the dequantized weights is what product_blocks computes, to fp32 rounding."""
    bs = block_type(type_name).weights
    blocks = x.float().reshape(-1, bs)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv)  # torch.round: half to even, as vcvtps2dq / nearbyintf
    return (q * (amax / 127.0)).reshape(x.shape)


def fp8_values(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
               ) -> torch.Tensor:
    """FP8 weights [..., rows, cols] (float8 codes) times their block scales [..., ceil(rows /
    bo), ceil(cols / bi)] (a checkpoint's weight_scale_inv, as DeepSeek's weight_dequant
    multiplies them) -> fp32."""
    bo, bi = block
    rows, cols = codes.shape[-2:]
    full = scale.float().repeat_interleave(bo, dim=-2)[..., :rows, :].repeat_interleave(
        bi, dim=-1)[..., :cols]
    return codes.float() * full


@dataclass
class BlockMatrix:
    """A dense weight kept in its GGUF block types (an lm_head, a layer's q | k | v): N rows
    of K weights in up to three segments, each `rows` rows of one type (q, k and v may differ:
    Q4_K_M keeps v in Q6_K), `data` the segments' rows of blocks one after another as the file
    stores them. Backends with a kernel read it as it is (CpuBackend: strata_linear_blocks);
    `dequantize` is the reference."""

    data: torch.Tensor  # uint8 [total bytes]
    in_features: int  # K
    segments: tuple[tuple[str, int], ...]  # (block type, rows) in order

    @property
    def out_features(self) -> int:
        return sum(rows for _, rows in self.segments)

    @property
    def block_types(self) -> tuple[str, ...]:
        return tuple(t for t, _ in self.segments)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 [*ids.shape, K]: the rows `ids` dequantized (an embedding lookup; one
        segment)."""
        (name, n), = self.segments
        row_bytes = block_type(name).row_bytes(self.in_features)
        picked = self.data.view(n, row_bytes)[ids.reshape(-1).to(self.data.device)]
        return dequantize(picked, name).view(*ids.shape, self.in_features)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def row_bytes(self) -> int:
        """Bytes of one row (one segment)."""
        (name, _), = self.segments
        return block_type(name).row_bytes(self.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in dtype."""
        parts, at = [], 0
        for name, rows in self.segments:
            n = rows * block_type(name).row_bytes(self.in_features)
            parts.append(dequantize(self.data[at:at + n], name).view(rows, self.in_features))
            at += n
        return torch.cat(parts).to(dtype)


def fp8_kept(shapes: list[tuple[int, int]], block: tuple[int, int]) -> bool:
    """Whether FP8 weights of these [out_i, in] shapes stay one Fp8Matrix (q | k | v
    concatenated): the same inputs, a multiple of 8 as the kernels read them (and the scale
    blocks' inputs too), and whole blocks of rows in every part but the last."""
    return (len({k for _, k in shapes}) == 1 and shapes[0][1] % 8 == 0 and block[1] % 8 == 0
            and all(n % block[0] == 0 for n, _ in shapes[:-1]))


@dataclass
class Fp8Matrix:
    """A dense weight kept as an FP8 checkpoint stores it: N rows of K float8 e4m3 codes with an
    fp32 scale per bo x bi block (DeepSeek's weight_scale_inv layout), several tensors' rows
    concatenated when each has whole blocks of rows (q | k | v). Backends with a kernel read it
    as it is (CpuBackend: strata_linear_fp8; TritonBackend: gpu_blocks.linear_fp8);
    `dequantize` is the reference."""

    codes: torch.Tensor  # uint8 [N, K]
    scales: torch.Tensor  # fp32 [ceil(N / bo), ceil(K / bi)]
    block: tuple[int, int]  # (bo, bi)

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + 4 * self.scales.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in dtype: code * its block's scale."""
        return fp8_values(self.codes.view(torch.float8_e4m3fn), self.scales,
                          self.block).to(dtype)
