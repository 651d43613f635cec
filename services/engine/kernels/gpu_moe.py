"""Routed experts on a CUDA device: three Triton launches per MoE layer, each expert's weights
read by address where they lie — a slot of the pool, a staging buffer, or the pinned host store
itself (over the link, zero-copy: with unified addressing a pinned host page is readable by the
device). No gather, no per-expert dispatch, the same arithmetic wherever the blob is.

Shape legend: T tokens, K routed per token, D hidden, F expert FFN, M = T*K (token, expert)
rows, G groups.

The rows are sorted per token by ascending expert id (that is the order each token's outputs
are summed in, as on the CPU), then grouped by expert into groups of at most BLOCK_M rows; a
group is (its expert blob's address, its first sorted row, its row count):

    gate_up  (group, F block):  act[r] = silu(x[tok[r]] @ gate) * (x[tok[r]] @ up)     [M, F]
    down     (group, D block):  y[dst[r]] = w[r] * (act[r] @ down)                       [M, D]

(or gpt-oss's clamped activation, and each expert's biases added to the products, read from
the end of its blob: Weights.act / bias_at, model/layers/mlp.py's ExpertMlp)
    combine  (token, D block):  out[t] = y[t*K] + y[t*K+1] + ... + y[t*K+K-1]           [T, D]

`moe(..., groups)` takes groups built on the host (`group_rows`: several rows of an expert share
a group, so each weight tile is read once for them — prefill, batched decode) and may run them
in two launches of the first two kernels (`split`): the
groups whose weights are ready, then — after the caller has waited for its copies — the rest,
so hits start before the copied misses they would otherwise wait for. `moe_device` builds
one group per row on the device from a device table of blob addresses, with no host work: what
a decode step captured in a CUDA graph runs. Both give the same bits (see below).

Numerics: every output row is a fixed-order computation over its own row alone (fp32
accumulation; `tl.dot` in IEEE fp32 for fp32 weights), so a token's result does not depend on
the other tokens of the step, on its group's size or on where the blob lies (tested on the
device; Triton's CPU interpreter computes tl.dot with numpy, whose blocking varies by shape).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from services.engine.kernels import gpu_blocks
from services.engine.model.blocks import block_type
from services.engine.model.layers.mlp import ACTIVATIONS

BLOCK_M = 16  # rows of one expert per program (tl.dot's minimum)
BLOCK_F = 64  # expert FFN columns per gate_up program / reduction chunk of down
BLOCK_D = 64  # hidden columns per down/combine program / reduction chunk of gate_up

DENSE, BLOCKS, FP8 = 0, 1, 2  # what a blob holds (Weights.kind)


@dataclass(frozen=True)
class Weights:
    """What the kernels read a blob as, compiled in (each distinct Weights is one build):

    DENSE   services.engine.cache.layout's expert blob ([out, in]), in the activations' dtype
    BLOCKS  GGUF block types as stored (cache/formats.py's BlockFormat): gate rows, up rows,
            down rows of blocks, each matrix in its own type (kernels/gpu_blocks.py)
    FP8     e4m3 codes of gate, up, down, then their fp32 block scales (Fp8Format)

    and what the experts compute on them: the activation (ACT_SILU, ACT_CLAMPED with alpha and
    limit) and, bias_at >= 0, fp32 biases at that byte of each blob.
    """

    kind: int = DENSE
    types: tuple[int, int, int] = (0, 0, 0)  # BLOCKS: gate, up, down block type codes
    row_bytes: tuple[int, int, int] = (0, 0, 0)  # BLOCKS: bytes of one row of each
    block: tuple[int, int] = (1, 1)  # FP8: rows and columns of a scale block
    act: int = 0  # ACTIVATIONS.index: 0 SwiGLU, 1 gpt-oss's clamped SwiGLU
    alpha: float = 1.702
    limit: float = 7.0
    bias_at: int = -1  # the biases' byte offset in a blob, or -1: none

    @classmethod
    def of(cls, fmt: Any) -> Weights:
        """What blobs of the one-layer expert format `fmt` (cache/formats.py's ExpertFormat,
        after at(layer)) hold."""
        if fmt.kernel_weights == "blocks":
            w = cls.blocks(fmt.kernel_types, fmt.hidden_size, fmt.ffn_size)
        elif fmt.kernel_weights == "fp8":
            w = cls.fp8(fmt.kernel_block)
        else:
            w = cls()
        mlp = fmt.mlp
        return replace(w, act=ACTIVATIONS.index(mlp.act), alpha=mlp.alpha, limit=mlp.limit,
                       bias_at=fmt.bias_at if mlp.bias else -1)

    @classmethod
    def blocks(cls, types: tuple[str, str, str], hidden: int, ffn: int) -> Weights:
        kinds = [block_type(name) for name in types]
        return cls(BLOCKS, tuple(t.kernel for t in kinds),  # type: ignore[arg-type]
                   (kinds[0].row_bytes(hidden), kinds[1].row_bytes(hidden),
                    kinds[2].row_bytes(ffn)))

    @classmethod
    def fp8(cls, block: tuple[int, int]) -> Weights:
        return cls(FP8, block=block)

    def constants(self) -> dict[str, int]:
        """The kernels' compile-time arguments."""
        return dict(KIND=self.kind, GT=self.types[0], UT=self.types[1], DT=self.types[2],
                    G_ROW=self.row_bytes[0], U_ROW=self.row_bytes[1], D_ROW=self.row_bytes[2],
                    BO=self.block[0], BI=self.block[1], ACT=self.act, ALPHA=self.alpha,
                    LIMIT=self.limit, BIAS_AT=self.bias_at)


@triton.jit
def _blob(g_addr_ptr, g, dtype, KIND: tl.constexpr):
    """Group g's blob: typed as the activations (DENSE) or as bytes."""
    return tl.load(g_addr_ptr + g).to(tl.pointer_type(dtype if KIND == 0 else tl.uint8))


@triton.jit
def _biases(g_addr_ptr, g, BIAS_AT: tl.constexpr):
    """Group g's expert biases: fp32 [gate F | up F | down D], BIAS_AT bytes into its blob."""
    return (tl.load(g_addr_ptr + g).to(tl.pointer_type(tl.uint8)) + BIAS_AT).to(
        tl.pointer_type(tl.float32))


@triton.jit
def _gate_up_tiles(blob, d, f, d_ok, f_ok, lut, dtype, D: tl.constexpr, F: tl.constexpr,
                   KIND: tl.constexpr, GT: tl.constexpr, UT: tl.constexpr, G_ROW: tl.constexpr,
                   U_ROW: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr):
    """gate and up weights [BLOCK_D, BLOCK_F] (rows d, columns f of gate_up_t), in dtype."""
    ok = d_ok[:, None] & f_ok[None, :]
    if KIND == 0:  # gate [F, D], up [F, D]: row f, column d
        gate = tl.load(blob + f[None, :] * D + d[:, None], mask=ok, other=0.0)
        up = tl.load(blob + D * F + f[None, :] * D + d[:, None], mask=ok, other=0.0)
    else:  # the same orientation, in blocks or codes
        r = tl.minimum(f, F - 1)[None, :]
        c = tl.minimum(d, D - 1)[:, None]
        if KIND == 1:
            gate = gpu_blocks.weights(blob, r, c, G_ROW, GT, lut)
            up = gpu_blocks.weights(blob + F * G_ROW, r, c, U_ROW, UT, lut)
        else:
            scales = (blob + 3 * D * F).to(tl.pointer_type(tl.float32))
            gate = gpu_blocks.fp8_weights(blob, scales, r, c, D, BO, BI)
            up = gpu_blocks.fp8_weights(blob + D * F, scales + tl.cdiv(F, BO) * tl.cdiv(D, BI),
                                        r, c, D, BO, BI)
        gate = tl.where(ok, gate, 0.0).to(dtype)
        up = tl.where(ok, up, 0.0).to(dtype)
    return gate, up


@triton.jit
def _down_tile(blob, f, d, f_ok, d_ok, lut, dtype, D: tl.constexpr, F: tl.constexpr,
               KIND: tl.constexpr, DT: tl.constexpr, G_ROW: tl.constexpr, U_ROW: tl.constexpr,
               D_ROW: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr):
    """down weights [BLOCK_F, BLOCK_D] (rows f, columns d of down_t), in dtype."""
    ok = f_ok[:, None] & d_ok[None, :]
    if KIND == 0:  # down [D, F]: row d, column f
        w = tl.load(blob + 2 * D * F + d[None, :] * F + f[:, None], mask=ok, other=0.0)
    else:  # the same orientation, in blocks or codes
        r = tl.minimum(d, D - 1)[None, :]
        c = tl.minimum(f, F - 1)[:, None]
        if KIND == 1:
            w = gpu_blocks.weights(blob + F * (G_ROW + U_ROW), r, c, D_ROW, DT, lut)
        else:
            scales = (blob + 3 * D * F).to(tl.pointer_type(tl.float32))
            w = gpu_blocks.fp8_weights(blob + 2 * D * F,
                                       scales + 2 * tl.cdiv(F, BO) * tl.cdiv(D, BI), r, c, F,
                                       BO, BI)
        w = tl.where(ok, w, 0.0).to(dtype)
    return w


@triton.jit
def _gate_up_kernel(x_ptr, tok_ptr, g_addr_ptr, g_start_ptr, g_len_ptr, act_ptr, lut,
                    D: tl.constexpr, F: tl.constexpr, IEEE: tl.constexpr, KIND: tl.constexpr,
                    GT: tl.constexpr, UT: tl.constexpr, DT: tl.constexpr, G_ROW: tl.constexpr,
                    U_ROW: tl.constexpr, D_ROW: tl.constexpr, BO: tl.constexpr,
                    BI: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr,
                    LIMIT: tl.constexpr, BIAS_AT: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr):
    g = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    blob = _blob(g_addr_ptr, g, dtype, KIND)
    start = tl.load(g_start_ptr + g)
    m = tl.arange(0, BLOCK_M)
    row_ok = m < tl.load(g_len_ptr + g)
    tok = tl.load(tok_ptr + start + m, mask=row_ok, other=0)
    f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    f_ok = f < F
    gate = tl.zeros((BLOCK_M, BLOCK_F), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_F), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_ok = d < D
        x = tl.load(x_ptr + tok[:, None] * D + d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_D]
        w_gate, w_up = _gate_up_tiles(blob, d, f, d_ok, f_ok, lut, dtype, D, F, KIND, GT, UT,
                                      G_ROW, U_ROW, BO, BI)
        if IEEE:
            gate += tl.dot(x, w_gate, input_precision="ieee")
            up += tl.dot(x, w_up, input_precision="ieee")
        else:
            gate += tl.dot(x, w_gate)
            up += tl.dot(x, w_up)
    if BIAS_AT >= 0:
        bias = _biases(g_addr_ptr, g, BIAS_AT)
        gate += tl.load(bias + f, mask=f_ok, other=0.0)[None, :]
        up += tl.load(bias + F + f, mask=f_ok, other=0.0)[None, :]
    if ACT == 1:  # gpt-oss: clamped, sigmoid(alpha g), (u + 1)
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
        act = gate * tl.sigmoid(ALPHA * gate) * (up + 1.0)
    else:
        act = gate * tl.sigmoid(gate) * up  # silu(gate) * up
    tl.store(act_ptr + (start + m)[:, None] * F + f[None, :],
             act.to(act_ptr.dtype.element_ty), mask=row_ok[:, None] & f_ok[None, :])


@triton.jit
def _down_kernel(act_ptr, dst_ptr, w_ptr, g_addr_ptr, g_start_ptr, g_len_ptr, y_ptr, lut,
                 D: tl.constexpr, F: tl.constexpr, IEEE: tl.constexpr,
                 KIND: tl.constexpr, GT: tl.constexpr, UT: tl.constexpr, DT: tl.constexpr,
                 G_ROW: tl.constexpr, U_ROW: tl.constexpr, D_ROW: tl.constexpr,
                 BO: tl.constexpr, BI: tl.constexpr, ACT: tl.constexpr, ALPHA: tl.constexpr,
                 LIMIT: tl.constexpr, BIAS_AT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr):
    g = tl.program_id(0)
    dtype = act_ptr.dtype.element_ty
    blob = _blob(g_addr_ptr, g, dtype, KIND)
    start = tl.load(g_start_ptr + g)
    m = tl.arange(0, BLOCK_M)
    row_ok = m < tl.load(g_len_ptr + g)
    dst = tl.load(dst_ptr + start + m, mask=row_ok, other=0)
    weight = tl.load(w_ptr + dst, mask=row_ok, other=0.0).to(tl.float32)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    y = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        f = f0 + tl.arange(0, BLOCK_F)
        f_ok = f < F
        a = tl.load(act_ptr + (start + m)[:, None] * F + f[None, :],
                    mask=row_ok[:, None] & f_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_F]
        w = _down_tile(blob, f, d, f_ok, d_ok, lut, dtype, D, F, KIND, DT, G_ROW, U_ROW,
                       D_ROW, BO, BI)  # [BLOCK_F, BLOCK_D]
        if IEEE:
            y += tl.dot(a, w, input_precision="ieee")
        else:
            y += tl.dot(a, w)
    if BIAS_AT >= 0:
        y += tl.load(_biases(g_addr_ptr, g, BIAS_AT) + 2 * F + d, mask=d_ok, other=0.0)[None, :]
    tl.store(y_ptr + dst[:, None] * D + d[None, :], weight[:, None] * y,
             mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _combine_kernel(y_ptr, out_ptr, D: tl.constexpr, K: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for k in tl.static_range(K):  # ascending expert id: the rows were sorted per token
        acc += tl.load(y_ptr + (t * K + k) * D + d, mask=d_ok, other=0.0)
    tl.store(out_ptr + t * D + d, acc.to(out_ptr.dtype.element_ty), mask=d_ok)


@dataclass
class Groups:
    """One layer's rows, sorted and grouped by expert (numpy, built on the host)."""

    tok: np.ndarray  # [M] token of each sorted row
    dst: np.ndarray  # [M] row of y (t*K + rank of the expert in token t's ascending list)
    start: np.ndarray  # [G] first sorted row of each group
    length: np.ndarray  # [G] rows in each group (1..BLOCK_M)
    expert: np.ndarray  # [G] expert of each group
    w_src: np.ndarray  # [M] top_w's flat index of the weight of y's row r


def group_rows(top_idx: np.ndarray, first: np.ndarray | None = None) -> Groups:
    """Sort the rows of top_idx [T, K] per token by expert and group them by expert, at most
    BLOCK_M rows a group; `first` [E] bool puts those experts' groups first (ascending expert
    id within each part)."""
    T, K = top_idx.shape
    order = np.argsort(top_idx, axis=1, kind="stable")  # [T, K] per token ascending expert
    by_token = np.take_along_axis(top_idx, order, axis=1).ravel()  # [M] expert of y's row
    rows = np.argsort(by_token, kind="stable")  # [M] y rows grouped by expert
    experts = by_token[rows]
    bounds = np.flatnonzero(np.diff(experts)) + 1
    run_start = np.concatenate(([0], bounds))  # one run per distinct expert
    run_len = np.diff(np.concatenate((run_start, [len(rows)])))
    chunks = -(-run_len // BLOCK_M)  # groups per run
    run_of = np.repeat(np.arange(len(run_start)), chunks)  # [G]
    offset = (np.arange(len(run_of)) - np.repeat(np.cumsum(chunks) - chunks, chunks)) * BLOCK_M
    start = run_start[run_of] + offset
    length = np.minimum(run_len[run_of] - offset, BLOCK_M)
    expert = experts[start]
    if first is not None:
        part = np.argsort(~first[expert], kind="stable")  # the `first` groups, then the rest
        start, length, expert = start[part], length[part], expert[part]
    src = (np.arange(T)[:, None] * K + order).ravel()  # top_w's flat index for y's row
    return Groups(tok=rows // K, dst=rows, start=start, length=length, expert=expert,
                  w_src=src)


def _launch(x: torch.Tensor, tok: torch.Tensor, dst: torch.Tensor, w_of_row: torch.Tensor,
            g_addr: torch.Tensor, g_start: torch.Tensor, g_len: torch.Tensor,
            act: torch.Tensor, y: torch.Tensor, ffn_size: int, weights: Weights) -> None:
    """gate_up then down over the groups given (G = len(g_addr) programs per column block)."""
    D, G = x.shape[1], len(g_addr)
    lut = gpu_blocks.lookup_table(x.device)
    common = dict(IEEE=x.dtype == torch.float32, **weights.constants(), BLOCK_M=BLOCK_M,
                  BLOCK_F=BLOCK_F, BLOCK_D=BLOCK_D)
    _gate_up_kernel[(G, triton.cdiv(ffn_size, BLOCK_F))](
        x, tok, g_addr, g_start, g_len, act, lut, D, ffn_size, **common)
    _down_kernel[(G, triton.cdiv(D, BLOCK_D))](
        act, dst, w_of_row, g_addr, g_start, g_len, y, lut, D, ffn_size, **common)


def _combine(y: torch.Tensor, T: int, K: int, dtype: torch.dtype) -> torch.Tensor:
    D = y.shape[1]
    out = torch.empty(T, D, dtype=dtype, device=y.device)
    _combine_kernel[(T, triton.cdiv(D, BLOCK_D))](y, out, D, K=K, BLOCK_D=BLOCK_D)
    return out


def moe(x: torch.Tensor, top_w: torch.Tensor, groups: Groups, blob_addr: np.ndarray,
        ffn_size: int, split: int | None = None,
        between: Callable[[], None] | None = None,
        weights: Weights = Weights()) -> torch.Tensor:
    """The routed experts of one layer: x [T, D] on the device, top_w [T, K] (device, in
    top_idx's order), blob_addr [E] int64 (each grouped expert's blob address, blobs holding
    `weights`) -> [T, D]. With `split`, groups [0, split) run first, then `between()` (e.g.
    waits for copies), then the rest."""
    T, D = x.shape
    K = top_w.shape[1]
    M, G = len(groups.tok), len(groups.start)
    device = x.device
    # one host -> device transfer for the layer's index arrays
    meta = np.concatenate((groups.tok, groups.dst, groups.w_src, groups.start, groups.length,
                           blob_addr[groups.expert])).astype(np.int64)
    meta_d = torch.from_numpy(meta).to(device)
    tok, dst, w_src = meta_d[:M], meta_d[M : 2 * M], meta_d[2 * M : 3 * M]
    g_start, g_len, g_addr = meta_d[3 * M :].view(3, G)
    w_of_row = top_w.reshape(-1)[w_src]  # [M]: the weight of y's row r
    act = torch.empty(M, ffn_size, dtype=x.dtype, device=device)
    y = torch.empty(M, D, dtype=torch.float32, device=device)
    x = x.contiguous()
    cut = G if split is None else split
    for g0, g1 in ((0, cut), (cut, G)):
        if g1 > g0:
            _launch(x, tok, dst, w_of_row, g_addr[g0:g1], g_start[g0:g1], g_len[g0:g1], act, y,
                    ffn_size, weights)
        if g0 == 0 and between is not None:
            between()
    return _combine(y, T, K, x.dtype)


def moe_device(x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor,
               blob_addr: torch.Tensor, ffn_size: int,
               weights: Weights = Weights()) -> torch.Tensor:
    """moe() with every index built on the device: top_idx, top_w [T, K] and blob_addr [E]
    int64 (each expert's blob address, e.g. one layer's row of a device table) on x's device;
    one group per (token, expert) row. No host synchronisation: CUDA-graph capturable."""
    T, D = x.shape
    K = top_idx.shape[1]
    M = T * K
    experts, order = torch.sort(top_idx, dim=1)  # [T, K] per token ascending expert id
    w_of_row = torch.gather(top_w, 1, order).reshape(-1)  # [M]
    rows = torch.arange(M, device=x.device)
    g_addr = blob_addr[experts.reshape(-1)]  # [M]
    g_len = torch.ones(M, dtype=torch.int64, device=x.device)
    act = torch.empty(M, ffn_size, dtype=x.dtype, device=x.device)
    y = torch.empty(M, D, dtype=torch.float32, device=x.device)
    _launch(x.contiguous(), rows // K, rows, w_of_row, g_addr, rows, g_len, act, y, ffn_size,
            weights)
    return _combine(y, T, K, x.dtype)


def expert_forward(x: torch.Tensor, blob: torch.Tensor, ffn_size: int,
                   weights: Weights = Weights()) -> torch.Tensor:
    """One expert on all rows of x [n, D] (device) from `blob`, on the device or pinned on the
    host -> [n, D] (unweighted): what the placement cost model times."""
    n = x.shape[0]
    groups = group_rows(np.zeros((n, 1), dtype=np.int64))
    ones = torch.ones(n, 1, dtype=x.dtype, device=x.device)
    return moe(x, ones, groups, np.array([blob.data_ptr()], dtype=np.int64), ffn_size,
               weights=weights)
