"""Strata's CPU kernels: `cpu_kernels.c`, built with the machine's C compiler at first use and
called through ctypes.

    kernels.load(mode)   the CpuKernels for --cpu-kernels auto (build if a compiler is there)
                         | on (must build) | off; None where torch ops run instead

The library is compiled for this CPU (-march=native) into a cache directory
(STRATA_KERNEL_CACHE, else $XDG_CACHE_HOME/strata/kernels, else ~/.cache/strata/kernels), keyed by
the source, the flags, the compiler and the CPU's feature flags, so a rebuild happens only when
one of them changes; a build takes about a second. It runs on torch's OpenMP thread pool (it
is loaded after torch, whose libgomp it then links to), so `--threads` applies to both.

What runs here (decode is bound by the weight bytes it reads; see docs/benchmarks.md):
  linear(x, w)        x [T, K] times a weight w [N, K] ([out, in], as stored) -> [T, N]
  matmul(x, w_t)      x [T, K] @ a pre-transposed w_t [K, N] -> [T, N] (routers, gates)
  router(x, router_t, k, renormalize)  softmax top-k routing and the rows per expert
  moe(x, top_idx, top_w, blob_addr)   one MoE layer's routed experts, read by address from
                                      the slots or the host store, weighted sum per row
  rms_norm, qk_norm_rope, decode_attention   the rest of a decode layer (paged K/V read by
                                      block table, no gather)
Activations are fp32; the weights of the products (linear's, the experts' blobs, the router's)
are fp32 or bf16, a bf16 weight widened exactly into the same fp32 products (bit-identical to
the fp32 kernel on the widened weight, at half the bytes). Every output row is computed the same
way whatever the other rows of the call are (see the numerics note in cpu_kernels.c). The inner
loops are tiled for the machine's vector registers (AVX-512, AVX2, or plain vectors).

On a CUDA device the same roles are played by Triton kernels: `gpu_ops` (norms, q/k norm and
RoPE, paged decode attention) and `gpu_moe` (the routed experts, read by address from slots or
in place from the pinned host store). Which of them a step uses is decided once, by the
backend the runner selects (kernels/backend.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from services.engine.model.blocks import BlockMatrix, Fp8Matrix, block_type
from services.engine.model.layers.mlp import ACTIVATIONS, SWIGLU, ExpertMlp

log = logging.getLogger("strata.engine")

SOURCE = Path(__file__).with_name("cpu_kernels.c")
ABI_VERSION = 15  # cpu_kernels.c's ABI_VERSION
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-fPIC", "-shared",
         "-std=gnu11")
MODES = ("auto", "on", "off")

_c_ptr = ctypes.c_void_p
_c_i64 = ctypes.c_int64


class KernelBuildError(RuntimeError):
    """The C kernels could not be built or loaded (no compiler, a compile error, ...)."""


def cache_dir() -> Path:
    if os.environ.get("STRATA_KERNEL_CACHE"):
        return Path(os.environ["STRATA_KERNEL_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "strata" / "kernels"


def find_compiler() -> str | None:
    """The C compiler the kernels are built with: the first of $CC, cc, gcc, clang on PATH."""
    return next((name for name in (os.environ.get("CC"), "cc", "gcc", "clang")
                 if name and shutil.which(name)), None)


def _compiler() -> str:
    cc = find_compiler()
    if cc is None:
        raise KernelBuildError("no C compiler found (looked for $CC, cc, gcc, clang)")
    return cc


def _cpu_fingerprint() -> str:
    """What -march=native depends on: the CPU's feature flags (Linux), else the machine."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def build(directory: Path | None = None) -> Path:
    """The compiled library for this source, compiler and CPU: from the cache, else built."""
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError) as exc:
        raise KernelBuildError(f"C compiler {cc!r} does not run: {exc}") from exc
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), version.encode(),
                                     _cpu_fingerprint().encode()])).hexdigest()[:16]
    directory = directory or cache_dir()
    target = directory / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)  # then an atomic rename: builds
    os.close(fd)  # racing in several processes never load a half-written file
    try:
        done = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True,
                              text=True, timeout=300)
        if done.returncode != 0:
            raise KernelBuildError(f"{cc} failed (exit {done.returncode}): "
                                   f"{done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    log.info("built the CPU kernels in %.1f s with %s (%s) -> %s",
             time.perf_counter() - t0, cc, version, target)
    return target


class DecodeLayer(ctypes.Structure):
    """cpu_kernels.c's struct strata_layer: one decoder layer's weight pointers. wtype is the
    type of wqkv, wo and router (CpuKernels.weight_type: 0 fp32, the default when omitted,
    1 bf16), unless qkv_types[0] is a block type code (BlockType.kernel): then wqkv is the
    q | k | v rows of blocks of a BlockMatrix (segment types qkv_types) and wo D rows of type
    o_type; the norm weights and KV pools are fp32."""

    _fields_ = [("in_norm", _c_ptr), ("post_norm", _c_ptr), ("wqkv", _c_ptr),
                ("q_norm", _c_ptr), ("k_norm", _c_ptr), ("wo", _c_ptr),
                ("k_pool", _c_ptr), ("v_pool", _c_ptr),
                ("router", _c_ptr), ("wtype", _c_i64), ("qkv_types", _c_i64 * 3),
                ("o_type", _c_i64)]


class DecodeStep(ctypes.Structure):
    """cpu_kernels.c's struct strata_step: one decode step's shapes, indices and buffers."""

    _fields_ = [*((name, _c_i64) for name in ("T", "D", "H", "G", "Hd", "P", "E", "K",
                                               "renormalize", "table_stride", "max_length")),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                *((name, _c_ptr) for name in ("cos_table", "sin_table", "positions", "slots",
                                              "tables", "lengths", "x", "add", "h", "qkv",
                                              "attn", "o", "scores", "top_idx", "top_w",
                                              "counts"))]


class _Workspace(threading.local):
    floats: torch.Tensor | None = None
    ints: torch.Tensor | None = None
    attention: torch.Tensor | None = None
    router: torch.Tensor | None = None
    blocks: torch.Tensor | None = None


class CpuKernels:
    """ctypes bindings of cpu_kernels.c. Inputs are fp32 CPU tensors, except the weights of the
    products (linear's w, the experts' blobs, the router, a DecodeLayer's wqkv / wo / router),
    which may be fp32 or bf16: a bf16 weight gives bit-identically the result of the fp32 kernel
    on the weight widened (`w.float()`), reading half the bytes. Outputs are new tensors."""

    WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1}  # cpu_kernels.c's WT_F32, WT_BF16
    # The dense expert blobs strata_moe reads (ExpertFormat.kernel_weights): WT_F32, WT_BF16,
    # and the same stored [in][out] (WT_F32_IO, WT_BF16_IO); "blocks": GGUF block types as
    # stored, their codes from the format (BlockFormat.kernel_types)
    MOE_WEIGHTS = {"fp32": 0, "bf16": 1, "fp32_io": 13, "bf16_io": 14, "blocks": None,
                   "fp8": 12}  # fp8: WT_FP8

    @classmethod
    def weight_type(cls, dtype: torch.dtype) -> int:
        """The kernels' wtype code of a weight dtype (0 fp32, 1 bf16)."""
        if dtype not in cls.WEIGHT_TYPES:
            raise TypeError(f"CPU kernel weights must be fp32 or bf16, not {dtype}")
        return cls.WEIGHT_TYPES[dtype]

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))
        if lib.strata_abi_version() != ABI_VERSION:
            raise KernelBuildError(f"{path} has ABI {lib.strata_abi_version()}, "
                                   f"expected {ABI_VERSION}")
        for name in ("strata_linear", "strata_matmul"):  # W [N][K] / W [K][N]
            getattr(lib, name).argtypes = [_c_ptr, _c_i64, _c_i64, _c_i64, _c_ptr, _c_i64,
                                           _c_i64, _c_ptr]
            getattr(lib, name).restype = None
        lib.strata_linear_blocks.argtypes = [_c_ptr, _c_i64, _c_i64, _c_i64, _c_ptr, _c_i64,
                                             _c_ptr, _c_ptr, _c_ptr, _c_ptr]
        lib.strata_linear_blocks.restype = None
        lib.strata_linear_fp8.argtypes = [_c_ptr, _c_i64, _c_i64, _c_i64, _c_ptr, _c_ptr,
                                          _c_i64, _c_i64, _c_i64, _c_ptr]
        lib.strata_linear_fp8.restype = None
        lib.strata_dequantize_rows.argtypes = [_c_ptr, _c_i64, _c_i64, _c_ptr, _c_i64, _c_ptr]
        lib.strata_dequantize_rows.restype = None
        lib.strata_block_work_bytes.argtypes = [_c_i64, _c_i64]
        lib.strata_block_work_bytes.restype = _c_i64
        lib.strata_moe.argtypes = [_c_ptr, _c_i64, _c_i64, _c_i64, _c_i64, _c_i64, _c_ptr,
                                   _c_ptr, _c_i64, _c_ptr, _c_ptr, _c_i64, ctypes.c_float,
                                   ctypes.c_float, _c_i64, _c_ptr, _c_ptr, _c_ptr]
        lib.strata_moe.restype = None
        lib.strata_moe_work_floats.argtypes = [_c_i64, _c_i64, _c_i64, _c_i64]
        lib.strata_moe_work_floats.restype = _c_i64
        lib.strata_moe_work_ints.argtypes = [_c_i64, _c_i64, _c_i64]
        lib.strata_moe_work_ints.restype = _c_i64
        lib.strata_rms_norm.argtypes = [_c_ptr, _c_i64, _c_i64, _c_i64, _c_ptr, ctypes.c_float,
                                        _c_ptr, _c_i64]
        lib.strata_rms_norm.restype = None
        lib.strata_qk_norm_rope.argtypes = [_c_ptr, _c_i64, _c_i64, _c_i64, _c_i64, _c_i64,
                                            _c_ptr, _c_ptr, ctypes.c_float, _c_ptr, _c_ptr,
                                            _c_ptr]
        lib.strata_qk_norm_rope.restype = None
        lib.strata_decode_attention.argtypes = [_c_ptr, _c_i64, _c_i64, _c_i64, _c_i64, _c_i64,
                                                _c_ptr, _c_ptr, _c_i64, _c_ptr, _c_i64, _c_ptr,
                                                _c_i64, ctypes.c_float, _c_ptr, _c_i64,
                                                _c_ptr, _c_ptr]
        lib.strata_decode_attention.restype = None
        lib.strata_router.argtypes = [_c_ptr, _c_i64, _c_i64, _c_ptr, _c_i64, _c_i64, _c_i64,
                                      ctypes.c_int, _c_ptr, _c_ptr, _c_ptr, _c_ptr]
        lib.strata_router.restype = None
        lib.strata_decode_layer.argtypes = [ctypes.POINTER(DecodeLayer),
                                            ctypes.POINTER(DecodeStep)]
        lib.strata_decode_layer.restype = None
        lib.strata_decode_step.argtypes = [_c_ptr, _c_i64, ctypes.POINTER(DecodeStep), _c_ptr,
                                           _c_ptr, _c_i64, _c_i64, _c_i64, ctypes.c_float,
                                           ctypes.c_float, _c_i64, _c_ptr, _c_ptr, _c_ptr,
                                           _c_ptr, _c_ptr]
        lib.strata_decode_step.restype = None
        self._lib = lib
        self._work = _Workspace()

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [T, K] (fp32, rows may be strided) times w [N, K] (fp32 or bf16, contiguous:
        a weight as the checkpoint stores it), transposed -> [T, N] fp32."""
        N, K = w.shape
        return self._product(self._lib.strata_linear, x, w, K, N)

    def matmul(self, x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
        """x [T, K] (fp32, rows may be strided) @ w_t [K, N] (fp32 or bf16, contiguous)
        -> [T, N] fp32."""
        K, N = w_t.shape
        return self._product(self._lib.strata_matmul, x, w_t, K, N)

    def _product(self, fn: Callable[..., None], x: torch.Tensor, w: torch.Tensor, K: int,
                 N: int) -> torch.Tensor:
        T = x.shape[0]
        assert x.dtype == torch.float32 and x.shape[1] == K and x.stride(1) == 1
        assert w.is_contiguous()
        y = torch.empty(T, N)
        fn(x.data_ptr(), T, K, x.stride(0), w.data_ptr(), self.weight_type(w.dtype), N,
           y.data_ptr())
        return y

    def linear_blocks(self, x: torch.Tensor, w: BlockMatrix) -> torch.Tensor:
        """x [T, K] (fp32, rows may be strided) times the rows of a BlockMatrix (its segments'
        blocks as stored), transposed -> [T, N] fp32; x is rounded to 8 bits per value first
        (cpu_kernels.c's product_blocks)."""
        T, K = x.shape
        assert x.dtype == torch.float32 and w.in_features == K and x.stride(1) == 1
        assert w.data.dtype == torch.uint8 and w.data.is_contiguous()
        types = np.array([block_type(t).kernel for t in w.block_types], dtype=np.int64)
        rows = np.array([r for _, r in w.segments], dtype=np.int64)
        work = self._workspace("blocks", torch.uint8, self._lib.strata_block_work_bytes(T, K))
        y = torch.empty(T, w.out_features)
        self._lib.strata_linear_blocks(x.data_ptr(), T, K, x.stride(0), w.data.data_ptr(),
                                       len(types), types.ctypes.data, rows.ctypes.data,
                                       y.data_ptr(), work.data_ptr())
        return y

    def dequantize_rows(self, w: BlockMatrix, ids: torch.Tensor) -> torch.Tensor:
        """fp32 [*ids.shape, K]: rows `ids` of a one-segment BlockMatrix dequantized (an
        embedding lookup; BlockMatrix.rows is the reference)."""
        (name, n), = w.segments
        assert w.data.dtype == torch.uint8 and w.data.is_contiguous()
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        if flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < n:
            raise IndexError(f"row ids outside the {n} rows of the matrix")
        y = torch.empty(flat.numel(), w.in_features)
        self._lib.strata_dequantize_rows(w.data.data_ptr(), block_type(name).kernel,
                                         w.in_features, flat.data_ptr(), flat.numel(),
                                         y.data_ptr())
        return y.view(*ids.shape, w.in_features)

    def linear_fp8(self, x: torch.Tensor, w: Fp8Matrix) -> torch.Tensor:
        """x [T, K] (fp32, rows may be strided) times an Fp8Matrix (codes and block scales as
        stored), transposed -> [T, N] fp32: each code converted exactly, an fp32 dot per
        scale block, one FMA by its scale (cpu_kernels.c's product_fp8)."""
        T, K = x.shape
        assert x.dtype == torch.float32 and w.in_features == K and x.stride(1) == 1
        assert K % 8 == 0 and w.block[1] % 8 == 0, "inputs and scale blocks of multiples of 8"
        assert w.codes.is_contiguous() and w.scales.is_contiguous()
        assert w.scales.dtype == torch.float32
        y = torch.empty(T, w.out_features)
        bo, bi = w.block
        self._lib.strata_linear_fp8(x.data_ptr(), T, K, x.stride(0), w.codes.data_ptr(),
                                    w.scales.data_ptr(), w.out_features, bo, bi, y.data_ptr())
        return y

    def moe(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor,
            blob_addr: np.ndarray, ffn_size: int, splits: int,
            weights: str = "fp32", block_types: tuple[str, str, str] | None = None,
            fp8_block: tuple[int, int] | None = None, mlp: ExpertMlp = SWIGLU,
            bias_at: int = -1) -> torch.Tensor:
        """Routed experts of one layer: x [T, D], top_idx [T, K] (int64), top_w [T, K] (fp32),
        blob_addr [E] (int64 address of each routed expert's blob: `weights` fp32 or bf16 in
        cache/layout.py's [out, in] layout, fp32_io or bf16_io in its [in, out] one (an
        ExpertLayout with inputs_major), "blocks": GGUF rows of blocks, gate's, up's and
        down's types `block_types`, or "fp8": float8 e4m3 codes then their scales per
        `fp8_block` block, cache/formats.py's Fp8Format; with mlp.bias, fp32 biases at byte
        `bias_at` of each) -> [T, D] weighted sums (fp32). `mlp`: the activation."""
        T, D = x.shape
        K = top_idx.shape[1]
        E = blob_addr.shape[0]
        assert x.dtype == top_w.dtype == torch.float32 and top_idx.dtype == torch.int64
        assert blob_addr.dtype == np.int64
        wtypes = self.moe_weight_types(weights, block_types, fp8_block)
        assert x.is_contiguous() and top_idx.is_contiguous() and top_w.is_contiguous()
        floats = self._workspace("floats", torch.float32,
                                 self._lib.strata_moe_work_floats(T, K, D, ffn_size))
        ints = self._workspace("ints", torch.int64, self._lib.strata_moe_work_ints(T, K, E))
        y = torch.empty(T, D)
        self._lib.strata_moe(x.data_ptr(), T, D, ffn_size, splits, K, top_idx.data_ptr(),
                             top_w.data_ptr(), E, blob_addr.ctypes.data, wtypes.ctypes.data,
                             ACTIVATIONS.index(mlp.act), mlp.alpha, mlp.limit,
                             bias_at if mlp.bias else -1, y.data_ptr(), floats.data_ptr(),
                             ints.data_ptr())
        return y

    def moe_weight_types(self, weights: str, block_types: tuple[str, str, str] | None = None,
                         fp8_block: tuple[int, int] | None = None) -> np.ndarray:
        """strata_moe's wtypes [5] for blobs of kind `weights` (see moe)."""
        if weights == "blocks":
            assert block_types is not None
            return np.array([block_type(t).kernel for t in block_types] + [0, 0],
                            dtype=np.int64)
        if weights == "fp8":
            assert fp8_block is not None
            return np.array([self.MOE_WEIGHTS["fp8"]] * 3 + list(fp8_block), dtype=np.int64)
        return np.full(5, self.MOE_WEIGHTS[weights], dtype=np.int64)

    def router(self, x: torch.Tensor, router_t: torch.Tensor, k: int, renormalize: bool
               ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """Softmax top-k routing of x [T, D] (fp32) by router_t [D, E] (fp32 or bf16)
        -> (experts [T, k] int64, weights [T, k] fp32, rows per expert [E] int64)."""
        T, D = x.shape
        E = router_t.shape[1]
        assert x.dtype == torch.float32 and x.is_contiguous()
        assert router_t.is_contiguous() and router_t.shape[0] == D
        wtype = self.weight_type(router_t.dtype)
        top_idx = torch.empty(T, k, dtype=torch.int64)
        top_w = torch.empty(T, k)
        counts = np.empty(E, dtype=np.int64)
        work = self._workspace("router", torch.float32, T * E)
        self._lib.strata_router(x.data_ptr(), T, D, router_t.data_ptr(), wtype, E, k, renormalize,
                                top_idx.data_ptr(), top_w.data_ptr(), counts.ctypes.data,
                                work.data_ptr())
        return top_idx, top_w, counts

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of each row of x [R, D] (rows may be strided) times weight [D] -> [R, D]."""
        R, D = x.shape
        assert x.dtype == weight.dtype == torch.float32 and x.stride(1) == 1
        out = torch.empty(R, D)
        self._lib.strata_rms_norm(x.data_ptr(), R, D, x.stride(0), weight.data_ptr(), eps,
                                  out.data_ptr(), D)
        return out

    def qk_norm_rope(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                     q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                     cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> None:
        """In place on qkv [T, (H + 2G) * Hd] (q | k | v): per q and k head RMSNorm (weights
        [Hd], or none) then RoPE with the rows `positions` [T] of cos/sin [N, Hd]."""
        T = qkv.shape[0]
        assert qkv.dtype == torch.float32 and qkv.stride(1) == 1 and positions.dtype == torch.int64
        assert cos.is_contiguous() and sin.is_contiguous() and positions.is_contiguous()
        self._lib.strata_qk_norm_rope(
            qkv.data_ptr(), T, qkv.stride(0), num_heads, num_kv_heads, head_dim,
            None if q_norm is None else q_norm.data_ptr(),
            None if k_norm is None else k_norm.data_ptr(), eps, cos.data_ptr(), sin.data_ptr(),
            positions.data_ptr())

    def decode_attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                         tables: torch.Tensor, lengths: torch.Tensor, max_length: int,
                         sinks: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
        """One query token per row over its paged K/V: q [R, H, Hd] (rows may be strided),
        pools [blocks, P, G, Hd], tables [R, nb] block ids, lengths [R] (at most max_length)
        -> [R, H, Hd]. sinks [H] fp32: a logit per head in the softmax with no value;
        window > 0: only each row's last `window` positions."""
        R, H, Hd = q.shape
        _, P, G, _ = k_pool.shape
        assert q.dtype == k_pool.dtype == v_pool.dtype == torch.float32
        assert q.stride(2) == 1 and q.stride(1) == Hd
        assert k_pool.is_contiguous() and v_pool.is_contiguous() and tables.is_contiguous()
        assert tables.dtype == lengths.dtype == torch.int64 and lengths.is_contiguous()
        assert sinks is None or (sinks.dtype == torch.float32 and sinks.is_contiguous())
        work = self._workspace("attention", torch.float32, R * H * max_length)
        out = torch.empty(R, H, Hd)
        self._lib.strata_decode_attention(
            q.data_ptr(), R, q.stride(0), H, G, Hd, k_pool.data_ptr(), v_pool.data_ptr(), P,
            tables.data_ptr(), tables.stride(0), lengths.data_ptr(), max_length, Hd**-0.5,
            None if sinks is None else sinks.data_ptr(), window, out.data_ptr(),
            work.data_ptr())
        return out

    def decode_layer(self, layer: DecodeLayer, step: DecodeStep) -> None:
        """The attention half of a decoder layer and its router on a decode step's rows, in
        place on the step's buffers (see strata_decode_layer)."""
        self._lib.strata_decode_layer(ctypes.byref(layer), ctypes.byref(step))

    def decode_step(self, layers: ctypes.Array, step: DecodeStep, addresses: np.ndarray,
                    wtypes: np.ndarray, ffn_size: int, splits: int, mlp: ExpertMlp,
                    bias_at: int, route_top: np.ndarray, route_counts: np.ndarray) -> None:
        """Every decoder layer of a decode step in one call (see strata_decode_step): per
        layer l decode_layer(layers[l], step), then the routed experts at addresses [L, E]
        (wtypes [L, 5]: moe_weight_types of each layer); step.x ends as the last layer's
        output, each layer's top-K in route_top [L, T, K] and its rows per expert in
        route_counts [L, E] (int64)."""
        T, D, K, E = step.T, step.D, step.K, step.E
        L = len(layers)
        assert addresses.shape == (L, E) and addresses.dtype == np.int64
        assert wtypes.shape == (L, 5) and wtypes.dtype == np.int64
        assert route_top.shape == (L, T, K) and route_top.dtype == np.int64
        assert route_counts.shape == (L, E) and route_counts.dtype == np.int64
        assert addresses.flags.c_contiguous and wtypes.flags.c_contiguous
        assert route_top.flags.c_contiguous and route_counts.flags.c_contiguous
        work_floats = self._lib.strata_moe_work_floats(T, K, D, ffn_size)
        floats = self._workspace("floats", torch.float32, work_floats + T * D)  # work, then y
        ints = self._workspace("ints", torch.int64, self._lib.strata_moe_work_ints(T, K, E))
        y = floats.data_ptr() + 4 * work_floats
        self._lib.strata_decode_step(ctypes.addressof(layers), L, ctypes.byref(step),
                                     addresses.ctypes.data, wtypes.ctypes.data, ffn_size,
                                     splits, ACTIVATIONS.index(mlp.act), mlp.alpha, mlp.limit,
                                     bias_at if mlp.bias else -1, route_top.ctypes.data,
                                     route_counts.ctypes.data, y,
                                     floats.data_ptr(), ints.data_ptr())

    def _workspace(self, name: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A per-thread scratch buffer of at least numel elements, grown (never shrunk)."""
        buf = getattr(self._work, name)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 2 * (0 if buf is None else buf.numel())), dtype=dtype)
            setattr(self._work, name, buf)
        return buf


_loaded: dict[str, CpuKernels | KernelBuildError] = {}  # the built library, once a process


def load(mode: str = "auto") -> CpuKernels | None:
    """The CPU kernels for `--cpu-kernels` mode: auto (use them if they build), on (raise if
    they do not), off (None). The library is built and loaded once per process; which
    kernels a component uses is its backend's choice (kernels/backend.py), not state here."""
    if mode not in MODES:
        raise ValueError(f"cpu kernels mode must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "off":
        return None
    if "lib" not in _loaded:
        try:
            _loaded["lib"] = CpuKernels(build())
        except (KernelBuildError, OSError) as exc:
            _loaded["lib"] = KernelBuildError(str(exc))
            if mode == "auto":
                log.warning("CPU kernels unavailable (%s): decode runs on torch ops instead, "
                            "about 1.5x slower at batch 1. Install a C compiler with OpenMP "
                            "(gcc) to get them, or set --cpu-kernels off to silence this.", exc)
    lib = _loaded["lib"]
    if isinstance(lib, KernelBuildError):
        if mode == "on":
            raise KernelBuildError(f"--cpu-kernels on, but the CPU kernels are not "
                                   f"available: {lib}") from lib
        return None
    return lib


def release_thread_pool() -> bool:
    """Free the OpenMP worker threads of the calling thread's team (OpenMP 5's
    omp_pause_resource_all, in the libgomp torch loaded); True if it did.

    libgomp keeps a pool of workers per thread that has opened a parallel region, and once it
    manages more threads than the machine has cores, every barrier stops spinning after ~1000
    rounds and sleeps: each region then waits for its workers to wake. A process that loads a
    model on its main thread (the main thread's pool) and decodes on another (a second pool)
    crosses that line on a small machine: measured on 2 cores, a decode step replayed on the
    loop thread took 6.0-7.6 ms with the main thread's pool alive and 4.0-4.6 ms once it was
    freed (bench preset, BF16). The engine frees the loading thread's pool when its loop
    starts (core.Engine.start); a later parallel region on that thread builds a new one."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line.split()[-1]}
    except OSError:  # not Linux
        return False
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            return lib.omp_pause_resource_all(1) == 0  # omp_pause_soft
        except (OSError, AttributeError):  # no such runtime, or one before OpenMP 5
            continue
    return False


def forget() -> None:
    """Drop the loaded library so the next load() builds again (tests of the build path)."""
    _loaded.clear()
