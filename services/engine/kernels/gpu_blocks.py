"""Weights as a checkpoint stores them, dequantized in registers inside the Triton kernels: the
GGUF block types of services.engine.model.blocks and FP8 codes with block scales.

`weights(p, r, c, ...)` is weight (r, c) of a matrix whose rows of blocks start at the byte
pointer p (row r at p + r * row_bytes): r and c are index tensors that broadcast to the tile a
kernel wants ([BLOCK_D, BLOCK_F] of a gate matrix, say), so a tile can be read in either
orientation. Each element reads its own quant and its block's scales (the repeated reads of a
block's scales hit the cache); every index must be in range (callers clamp their tails and mask
the result). `fp8_weights` is the same for FP8 codes and their scales. The arithmetic is the
torch reference's (services.engine.model.blocks.dequantize, gguf-py's bits), in fp32, so a
tile equals the reference dequantization of its weights (to the last bit where the compiler
does not fuse a multiply-add).

`linear` is a dense product on a BlockMatrix (lm_head, attention projections as the file stores
them) built on `weights`, `linear_fp8` the same on an Fp8Matrix built on `fp8_weights`.

`TYPE` is the block type's BlockType.kernel code (the C kernels' WT_* numbering), a constexpr:
each kernel is compiled for the types of the matrices it reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.model.blocks import (
    BLOCK_TYPES,
    FP4_VALUES,
    IQ4_VALUES,
    BlockMatrix,
    Fp8Matrix,
    block_type,
)

CODES = {name: t.kernel for name, t in BLOCK_TYPES.items()}  # "Q4_K" -> 6
Q8_0, Q4_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, MXFP4, IQ4_XS = (
    CODES[n] for n in ("Q8_0", "Q4_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "MXFP4",
                       "IQ4_XS"))
IQ4_AT, FP4_AT = 0, 16  # the lookup table: IQ4_NL's 16 values, then E2M1's (doubled)


_tables: dict[torch.device, torch.Tensor] = {}


def lookup_table(device: torch.device) -> torch.Tensor:
    """fp32 [32] the table types index (IQ4_NL / IQ4_XS, then MXFP4), on `device` (made once
    per device)."""
    if device not in _tables:
        _tables[device] = torch.tensor(IQ4_VALUES + FP4_VALUES, dtype=torch.float32,
                                       device=device)
    return _tables[device]


@triton.jit
def _u8(p, at):
    return tl.load(p + at).to(tl.int32)


@triton.jit
def _f16(p, at):
    """The fp16 at byte `at` (any alignment), as fp32."""
    bits = tl.load(p + at).to(tl.uint16) | (tl.load(p + at + 1).to(tl.uint16) << 8)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nibble(p, at, high):
    """The low (high == 0) or high (high == 1) 4 bits of byte `at`."""
    return (_u8(p, at) >> (4 * high)) & 15


@triton.jit
def weights(p, r, c, ROW_BYTES: tl.constexpr, TYPE: tl.constexpr, lut):
    """fp32 weight (r, c) of a matrix of TYPE blocks at p; `lut` the lookup_table()."""
    if TYPE == 2:  # Q8_0: fp16 d, int8 q[32]
        blk = r * ROW_BYTES + (c // 32) * 34
        q = tl.load(p + blk + 2 + c % 32).to(tl.int8, bitcast=True).to(tl.float32)
        w = _f16(p, blk) * q
    elif TYPE == 3:  # Q4_0: fp16 d, weight j in the low (j < 16) / high nibble of byte j % 16
        blk = r * ROW_BYTES + (c // 32) * 18
        j = c % 32
        w = _f16(p, blk) * (_nibble(p, blk + 2 + j % 16, j // 16).to(tl.float32) - 8)
    elif TYPE == 9:  # IQ4_NL: Q4_0's indices into the IQ4 table
        blk = r * ROW_BYTES + (c // 32) * 18
        j = c % 32
        w = _f16(p, blk) * tl.load(lut + _nibble(p, blk + 2 + j % 16, j // 16))
    elif TYPE == 10:  # MXFP4: E8M0 exponent e (2^(e - 128) with the doubled table), indices
        blk = r * ROW_BYTES + (c // 32) * 17
        j = c % 32
        e = _u8(p, blk)
        bits = tl.where(e < 2, 0x00200000 << tl.minimum(e, 1), (e - 1) << 23)
        w = bits.to(tl.float32, bitcast=True) * tl.load(
            lut + 16 + _nibble(p, blk + 1 + j % 16, j // 16))
    elif TYPE == 4:  # Q2_K: 16 scale/min bytes, 2-bit q[64], fp16 d, fp16 dmin
        blk = r * ROW_BYTES + (c // 256) * 84
        j = c % 256
        sc = _u8(p, blk + j // 16)
        q = (_u8(p, blk + 16 + 32 * (j // 128) + j % 32) >> (2 * ((j % 128) // 32))) & 3
        w = (_f16(p, blk + 80) * (sc & 15).to(tl.float32)) * q.to(tl.float32) - (
            _f16(p, blk + 82) * (sc >> 4).to(tl.float32))
    elif TYPE == 5:  # Q3_K: high bits[32], 2-bit q[64], 16 6-bit scales in 12 bytes, fp16 d
        blk = r * ROW_BYTES + (c // 256) * 110
        j = c % 256
        g = j // 16
        lo = (_u8(p, blk + 96 + g % 8) >> (4 * (g // 8))) & 15
        hi = (_u8(p, blk + 104 + g % 4) >> (2 * (g // 4))) & 3
        s = ((lo | (hi << 4)) - 32).to(tl.float32)
        n, cc, ll = j // 128, (j % 128) // 32, j % 32
        low = (_u8(p, blk + 32 + 32 * n + ll) >> (2 * cc)) & 3
        high = (_u8(p, blk + ll) >> (4 * n + cc)) & 1
        w = (_f16(p, blk + 108) * s) * ((low | (high << 2)) - 4).to(tl.float32)
    elif TYPE == 6 or TYPE == 7:  # Q4_K / Q5_K: d, dmin, 8 6-bit scales and mins, (qh), qs
        blk = r * ROW_BYTES + (c // 256) * (144 if TYPE == 6 else 176)
        j = c % 256
        s = j // 32
        k = s % 4
        a, b, e = _u8(p, blk + 4 + k), _u8(p, blk + 8 + k), _u8(p, blk + 12 + k)
        scale = tl.where(s < 4, a & 63, (e & 15) | ((a >> 6) << 4)).to(tl.float32)
        low_min = tl.where(s < 4, b & 63, (e >> 4) | ((b >> 6) << 4)).to(tl.float32)
        if TYPE == 6:
            q = _nibble(p, blk + 16 + 32 * (s // 2) + j % 32, s % 2)
        else:
            q = _nibble(p, blk + 48 + 32 * (s // 2) + j % 32, s % 2) | (
                ((_u8(p, blk + 16 + j % 32) >> s) & 1) << 4)
        w = (_f16(p, blk) * scale) * q.to(tl.float32) - _f16(p, blk + 2) * low_min
    elif TYPE == 8:  # Q6_K: low 4 bits[128], high 2 bits[64], int8 scales[16], fp16 d
        blk = r * ROW_BYTES + (c // 256) * 210
        j = c % 256
        n, cc, ll = j // 128, (j % 128) // 32, j % 32
        low = _nibble(p, blk + 64 * n + 32 * (cc % 2) + ll, cc // 2)
        high = (_u8(p, blk + 128 + 32 * n + ll) >> (2 * cc)) & 3
        s = tl.load(p + blk + 192 + j // 16).to(tl.int8, bitcast=True).to(tl.float32)
        w = (_f16(p, blk + 208) * s) * ((low | (high << 4)) - 32).to(tl.float32)
    else:  # TYPE == 11, IQ4_XS: fp16 d, uint16 high scale bits, 4 low-nibble bytes, indices
        blk = r * ROW_BYTES + (c // 256) * 136
        j = c % 256
        s = j // 32
        high = _u8(p, blk + 2) | (_u8(p, blk + 3) << 8)
        ls = ((_u8(p, blk + 4 + s // 2) >> (4 * (s % 2))) & 15) | (((high >> (2 * s)) & 3) << 4)
        jj = j % 32
        q = _nibble(p, blk + 8 + 16 * s + jj % 16, jj // 16)
        w = (_f16(p, blk) * (ls - 32).to(tl.float32)) * tl.load(lut + q)
    return w


@triton.jit
def _e4m3(code):
    """float8 e4m3fn code (int32 0..255) -> fp32 (no NaN: checkpoints hold none)."""
    sign = tl.where(code >= 128, -1.0, 1.0)
    exp, man = (code >> 3) & 15, code & 7
    normal = ((exp + 120) << 23 | man << 20).to(tl.float32, bitcast=True)
    return sign * tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal)  # man * 2^-9


@triton.jit
def fp8_weights(codes, scales, r, c, COLS: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr):
    """fp32 weight (r, c) of an FP8 matrix: codes (byte pointer) row-major with COLS columns,
    scales (fp32 pointer) one per BO x BI block, row-major; weight = code * scale."""
    code = _e4m3(tl.load(codes + r * COLS + c).to(tl.int32))
    return code * tl.load(scales + (r // BO) * ((COLS + BI - 1) // BI) + c // BI)


BLOCK_T, BLOCK_N, BLOCK_K = 16, 64, 64  # rows of x, output columns, reduction chunk


@triton.jit
def _linear_kernel(x_ptr, w_ptr, s_ptr, y_ptr, lut, T, x_stride, y_stride, N: tl.constexpr,
                   K: tl.constexpr, FP8: tl.constexpr, ROW_BYTES: tl.constexpr,
                   TYPE: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr, IEEE: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y = x @ W^T for W rows of TYPE blocks (FP8 false) or e4m3 codes with block scales at
    s_ptr (FP8 true)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    t_ok, n_ok = t < T, n < N
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(x_ptr + t[:, None] * x_stride + k[None, :],
                    mask=t_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_T, BLOCK_K]
        r, c = tl.minimum(n, N - 1)[None, :], tl.minimum(k, K - 1)[:, None]
        if FP8:
            w = fp8_weights(w_ptr, s_ptr, r, c, K, BO, BI)
        else:
            w = weights(w_ptr, r, c, ROW_BYTES, TYPE, lut)  # [BLOCK_K, BLOCK_N]: W[n, k]
        w = tl.where(k_ok[:, None] & n_ok[None, :], w, 0.0).to(x_ptr.dtype.element_ty)
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    tl.store(y_ptr + t[:, None] * y_stride + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=t_ok[:, None] & n_ok[None, :])


def _product(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, y: torch.Tensor,
             rows: int, **weights: int) -> None:
    """y [T, rows] (a view, rows y.stride(0) apart) = x @ the rows' weights, transposed."""
    T, K = x.shape
    _linear_kernel[(triton.cdiv(T, BLOCK_T), triton.cdiv(rows, BLOCK_N))](
        x, w, scales, y, lookup_table(x.device), T, x.stride(0), y.stride(0), rows, K,
        **{"FP8": False, "ROW_BYTES": 0, "TYPE": 0, "BO": 1, "BI": 1, **weights},
        IEEE=x.dtype == torch.float32, BLOCK_T=BLOCK_T, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)


def linear(x: torch.Tensor, w: BlockMatrix) -> torch.Tensor:
    """x [T, K] (on w's device, rows may be strided) times the rows of a BlockMatrix,
    transposed -> [T, N] in x's dtype (fp32 accumulation; IEEE fp32 products for fp32 x).
    One launch per segment, each writing its columns."""
    T, K = x.shape
    assert w.in_features == K and x.stride(1) == 1 and w.data.device == x.device
    y = torch.empty(T, w.out_features, dtype=x.dtype, device=x.device)
    at = col = 0
    for name, rows in w.segments:
        t = block_type(name)
        _product(x, w.data[at:], w.data, y[:, col:], rows, ROW_BYTES=t.row_bytes(K),
                 TYPE=t.kernel)
        at += rows * t.row_bytes(K)
        col += rows
    return y


def linear_fp8(x: torch.Tensor, w: Fp8Matrix) -> torch.Tensor:
    """x [T, K] (on w's device, rows may be strided) times an Fp8Matrix, transposed -> [T, N]
    in x's dtype: each code times its block's scale in registers, fp32 accumulation."""
    T, K = x.shape
    assert w.in_features == K and x.stride(1) == 1 and w.codes.device == x.device
    y = torch.empty(T, w.out_features, dtype=x.dtype, device=x.device)
    _product(x, w.codes, w.scales, y, w.out_features, FP8=True, BO=w.block[0], BI=w.block[1])
    return y
