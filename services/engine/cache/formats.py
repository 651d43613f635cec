"""Expert formats: what one pair's blob is, and what computes on it.

Shape legend: n tokens routed to one expert, D hidden, F expert FFN.

Every part of the cache deals in blobs of one format — the host store's rows, the slots, the
staging copies and the link carry `blob_bytes` each — and asks the format, never a type test,
what it may do with them:

    ExpertFormat          name, dtype (a blob's elements), numel, blob_bytes, describe()
      load(reader, layer, e, out) a pair from the checkpoint into its blob: its tensors read in
                                  read_dtype and packed, or its stored bytes as they are
      pack(gate, up, down, out)   a pair's checkpoint tensors -> its blob
      forward(x, blob)            one expert on its rows, torch ops on the blob's device (the
                                  reference; the per-expert path where no kernel applies)
      kernel_weights              what the address-reading kernels take these blobs as ("fp32",
                                  "bf16", "blocks", "fp8": the C strata_moe on the CPU and the
                                  Triton gpu_moe on CUDA), or None: the cache runs forward()
                                  per expert
      at(layer)                   the format of one layer's blobs (itself, but for BlockFormat)
      mlp                         what an expert computes on its weights (model/layers/mlp.py's
                                  ExpertMlp: the activation, whether it has biases); with
                                  biases, every blob ends in them: fp32 [gate F | up F | down D]
                                  at byte `bias_at` (16-aligned), after the weights
      exact_on(device, kernel)    whether a hit, a miss read in place and a staged copy give
                                  the same bits there

    DenseFormat     fp32 or bf16 weights in cache/layout.py's [out, in] layout (small experts
                    on the CPU: [in, out], inputs_major)
    QuantFormat     int8 / int4 weight-only quantization (model/quant.py), bytes
    Fp8Format       float8 e4m3 codes and block scales as an FP8 checkpoint stores them
    BlockFormat     GGUF block types (Q8_0, Q4_K, ...) as the file stores them: the pair's
                    gate, up and down rows of blocks, byte for byte; types may differ by layer
                    (at(layer): one layer's format)

A new format (another GGUF block type, FP8 with block scales) is one more class with these
members.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

import torch

from services.engine.cache.layout import ExpertLayout
from services.engine.model.blocks import FP8_STORED, block_type, dequantize, fp8_values
from services.engine.model.dtypes import dtype_name
from services.engine.model.layers.mlp import SWIGLU, ExpertMlp
from services.engine.model.quant import EXPERT_DTYPES, QUANT_SPECS, QuantExpertLayout

if TYPE_CHECKING:
    from services.engine.model.checkpoint import CheckpointReader

log = logging.getLogger("strata.engine")


class ExpertFormat(Protocol):
    name: str  # "fp32", "bf16", "int8", "int4", "q8_0", "q4_k+q6_k"
    hidden_size: int  # D
    ffn_size: int  # F
    dtype: torch.dtype  # a blob's element type
    numel: int  # elements per blob
    read_dtype: torch.dtype  # what the checkpoint's expert tensors are read in for pack()
    mlp: ExpertMlp  # the activation and biases the experts compute with
    bias_at: int  # byte offset of a blob's biases (mlp.bias), else -1

    @property
    def blob_bytes(self) -> int:
        """Bytes of one pair's blob: one slot, one copy over the link."""
        ...

    @property
    def kernel_weights(self) -> str | None:
        """What the address-reading MoE kernels take these blobs as, or None."""
        ...

    @property
    def kernel_types(self) -> tuple[str, str, str] | None:
        """For kernel_weights "blocks": the (gate, up, down) block types of a one-layer
        format's blobs (at(layer)); else None."""
        ...

    @property
    def kernel_block(self) -> tuple[int, int] | None:
        """For kernel_weights "fp8": the scale blocks' rows and columns; else None."""
        ...

    def describe(self) -> str: ...

    def at(self, layer: int) -> ExpertFormat:
        """The format of one layer's blobs."""
        ...

    def load(self, reader: CheckpointReader, layer: int, expert: int,
             out: torch.Tensor) -> None:
        """One pair from the checkpoint into its blob `out`."""
        ...

    def pack(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
             out: torch.Tensor) -> None:
        """HF-oriented weights (gate/up [F, D], down [D, F]) into the blob `out`."""
        ...

    def forward(self, x: torch.Tensor, blob: torch.Tensor) -> torch.Tensor:
        """One expert on its tokens: x [n, D] -> [n, D] (unweighted), in x's dtype."""
        ...


class _Common:
    """What every format shares: the blob size, exactness, loading a pair by reading and
    packing it, the biases after the weights; the layout formats pack, compute and unpack
    through their `layout`."""

    name: str
    hidden_size: int
    ffn_size: int
    dtype: torch.dtype
    numel: int
    layout: ExpertLayout | QuantExpertLayout

    read_dtype: torch.dtype
    mlp: ExpertMlp = SWIGLU
    bias_at: int = -1

    def _with_mlp(self, mlp: ExpertMlp) -> None:
        """Set the experts' MLP; with biases, grow the blob (numel, the weights' elements so
        far) by them: fp32 [2F + D] at the first 16-byte boundary after the weights."""
        self.mlp = mlp
        if mlp.bias:
            self.bias_at = -(-self.numel * self.dtype.itemsize // 16) * 16
            end = self.bias_at + 4 * self.bias_numel
            self.numel = -(-end // 16) * 16 // self.dtype.itemsize

    @property
    def bias_numel(self) -> int:
        return 2 * self.ffn_size + self.hidden_size

    def biases(self, blob: torch.Tensor) -> torch.Tensor | None:
        """A blob's biases (fp32 [gate F | up F | down D], a view), or None."""
        if self.bias_at < 0:
            return None
        raw = blob.view(torch.uint8)
        return raw[self.bias_at:self.bias_at + 4 * self.bias_numel].view(torch.float32)

    def load(self, reader: CheckpointReader, layer: int, expert: int,
             out: torch.Tensor) -> None:
        gate, up, down = reader.expert_weights(layer, expert, self.hidden_size, self.ffn_size,
                                               self.read_dtype)
        self.pack(gate, up, down, out)
        self._load_biases(reader, layer, expert, out)

    def _load_biases(self, reader: CheckpointReader, layer: int, expert: int,
                     out: torch.Tensor) -> None:
        if (bias := self.biases(out)) is not None:
            bias.copy_(reader.expert_biases(layer, expert, self.hidden_size, self.ffn_size))

    def pack(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
             out: torch.Tensor) -> None:
        self.layout.pack(gate, up, down, out)

    def forward(self, x: torch.Tensor, blob: torch.Tensor) -> torch.Tensor:
        if self.mlp.plain:
            return self.layout.forward(x, blob)
        return self._mlp_forward(x, blob)

    def _mlp_forward(self, x: torch.Tensor, blob: torch.Tensor) -> torch.Tensor:
        """The expert MLP (activation, biases) on the blob's weights, dequantized to x's
        dtype: the torch reference."""
        gate, up, down = self.weights(blob, x.dtype)
        bias = self.biases(blob)
        return self.mlp.forward(x, gate, up, down, None if bias is None else bias.to(x.dtype))

    def weights(self, blob: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [F, D], up [F, D], down [D, F]) of a blob, in `dtype` (copies)."""
        gate_up_t, down_t = self.views(blob)
        Fs = self.ffn_size
        return (gate_up_t[:, :Fs].T.to(dtype), gate_up_t[:, Fs:].T.to(dtype),
                down_t.T.to(dtype))

    def views(self, blob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The logical weights (gate_up_t [D, 2F], down_t [F, D]) of a blob, as copies."""
        return self.layout.views(blob[:self.layout.numel])

    @property
    def blob_bytes(self) -> int:
        return self.numel * self.dtype.itemsize

    kernel_weights: str | None = None
    kernel_types: tuple[str, str, str] | None = None  # block types, for kernel_weights "blocks"
    kernel_block: tuple[int, int] | None = None  # FP8 scale blocks, for kernel_weights "fp8"

    def at(self, layer: int) -> ExpertFormat:
        """The format of `layer`'s blobs: the same for every layer, except BlockFormat's."""
        return self  # type: ignore[return-value]

    def exact_on(self, device: torch.device, kernel: bool) -> bool:
        """Whether every placement gives a hit's bits on `device`: on the CPU the same code
        reads the same bytes wherever they lie; on CUDA only when the device kernel reads a
        miss in place (otherwise the CPU computes it, in other kernels)."""
        return device.type != "cuda" or kernel


class DenseFormat(_Common):
    """Unquantized weights (fp32 or bf16) in cache/layout.py's [out, in] layout, or with
    `inputs_major` its [in, out] one (small experts on the CPU: see inputs_major)."""

    def __init__(self, hidden_size: int, ffn_size: int, dtype: torch.dtype,
                 mlp: ExpertMlp = SWIGLU, inputs_major: bool = False):
        assert dtype in (torch.float32, torch.bfloat16), dtype
        self.layout = ExpertLayout(hidden_size, ffn_size, inputs_major)
        self.hidden_size, self.ffn_size, self.dtype = hidden_size, ffn_size, dtype
        self.name = dtype_name(dtype)
        self.numel = self.layout.numel
        self.read_dtype = dtype
        # "fp32" | "bf16", or "fp32_io" | "bf16_io" (the C kernel only: gpu_moe reads [out, in])
        self.kernel_weights = self.name + ("_io" if inputs_major else "")
        self._with_mlp(mlp)

    def _mlp_forward(self, x: torch.Tensor, blob: torch.Tensor) -> torch.Tensor:
        """In the blob's dtype, as layout.forward computes."""
        return super()._mlp_forward(x.to(blob.dtype), blob).to(x.dtype)

    def describe(self) -> str:
        stored = ", stored [in, out]" if self.layout.inputs_major else ""
        return f"{self.name} (unquantized{stored})"


# The largest expert matrix (D x F weights, in bytes) kept inputs-major on the CPU. Up to it a
# product is bound by arithmetic, not bytes, and the [out, in] kernel's lane sums cost about
# what its FMAs do; the [in, out] kernel has none: strata_moe at D 128 / F 64 bf16 (the
# default model) 1.2-1.4x at 8 and 36 rows (scripts/kernel_ab.py --inputs-major new), at
# 256 / 128 1.3-1.6x (fp32 at one row even). Larger experts keep the checkpoint's
# orientation, one sequential stream a row: at 512 / 256 fp32 (the bench preset, read from
# DRAM) [in, out] was even on an AVX-512 host and 20-25% slower on an AVX2 one
# (docs/benchmarks.md, 2026-12-03 and 2026-12-06).
INPUTS_MAJOR_MAX_BYTES = 128 << 10


def inputs_major(hidden_size: int, ffn_size: int, dtype: torch.dtype, device: torch.device,
                 cpu_kernels: bool) -> bool:
    """Whether unquantized experts of this shape are kept inputs-major: on the CPU, computed
    by the C kernels, with matrices of at most INPUTS_MAJOR_MAX_BYTES."""
    return (device.type == "cpu" and cpu_kernels
            and hidden_size * ffn_size * dtype.itemsize <= INPUTS_MAJOR_MAX_BYTES)



class QuantFormat(_Common):
    """Weight-only int8 / int4 (model/quant.py): a blob is bytes, dequantized inside the
    expert product to the activations' dtype; run per expert as torch ops."""

    def __init__(self, hidden_size: int, ffn_size: int, expert_dtype: str,
                 mlp: ExpertMlp = SWIGLU):
        self.layout = QuantExpertLayout(hidden_size, ffn_size, QUANT_SPECS[expert_dtype])
        self.hidden_size, self.ffn_size = hidden_size, ffn_size
        self.name, self.dtype, self.numel = expert_dtype, torch.uint8, self.layout.numel
        self.read_dtype = torch.float32  # quantized from the exact weights
        self._with_mlp(mlp)

    def describe(self) -> str:
        return self.layout.describe()



StackTypes = tuple[str, str, str]  # the GGUF block types of a layer's gate, up and down stacks


class _AsStored(_Common):
    """Formats whose blobs are the checkpoint's own encoding: the torch reference dequantizes
    a blob (`weights`, per format) and runs the expert MLP on it."""

    def weights(self, blob: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def views(self, blob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up, down = self.weights(blob, torch.float32)
        return torch.cat([gate, up]).T.contiguous(), down.T.contiguous()

    def forward(self, x: torch.Tensor, blob: torch.Tensor) -> torch.Tensor:
        return self._mlp_forward(x, blob)  # the weights dequantized, then the expert MLP


class BlockFormat(_AsStored):
    """Experts kept in the GGUF block types the file stores them in. A blob is the pair's gate
    rows, up rows and down rows of blocks (gate/up: F rows of D weights, down: D rows of F),
    the file's bytes unchanged. A file may store layers differently (Q4_K_M keeps some
    layers' down in Q6_K): `types` maps each MoE layer to its (gate, up, down) types, a blob
    holds the largest layer's bytes (smaller layers leave the tail unused), and `at(layer)` is
    the format of one layer's blobs. The C strata_moe reads the blocks in place (integer
    products, cpu_kernels.c's product_blocks), and so does the Triton gpu_moe on CUDA
    (dequantized in registers, kernels/gpu_blocks.py); forward() is the torch reference, which
    dequantizes exactly as the block type defines (gguf-py's dequantize gives the same bits)
    into the activations' dtype, and runs where no kernel takes the blocks."""

    def __init__(self, hidden_size: int, ffn_size: int, types: dict[int, StackTypes],
                 numel: int | None = None, mlp: ExpertMlp = SWIGLU):
        for gate, up, down in set(types.values()):
            for name, rows_of in ((gate, hidden_size), (up, hidden_size), (down, ffn_size)):
                per_block = block_type(name).weights  # ValueError for a type not kept
                if rows_of % per_block:
                    raise ValueError(f"{name} rows of {rows_of} weights are not whole blocks "
                                     f"of {per_block}")
        self.hidden_size, self.ffn_size, self.types = hidden_size, ffn_size, types
        self.dtype, self.read_dtype = torch.uint8, torch.uint8
        self.numel = numel or max(self._bytes(t)[3] for t in types.values())
        kinds = sorted({name for t in types.values() for name in t})
        self.name = "+".join(kinds).lower()  # "q8_0", "q4_k+q6_k"
        self.kernel_weights = "blocks"  # the C kernel reads the blocks as stored
        self._layers: dict[int, BlockFormat] = {}  # at(layer)'s formats, made once
        self._weight_numel = self.numel  # every layer's biases sit at the same offset
        self._with_mlp(mlp)

    def _bytes(self, t: StackTypes) -> tuple[int, int, int, int]:
        """(gate, up, down, total) bytes of one pair in the stack types t."""
        D, Fs = self.hidden_size, self.ffn_size
        gate, up = (Fs * block_type(n).row_bytes(D) for n in t[:2])
        down = D * block_type(t[2]).row_bytes(Fs)
        return gate, up, down, gate + up + down

    def at(self, layer: int) -> BlockFormat:
        """The format of `layer`'s blobs (same blob size)."""
        if len(set(self.types.values())) == 1:
            return self
        if layer not in self._layers:
            self._layers[layer] = BlockFormat(self.hidden_size, self.ffn_size,
                                              {layer: self.types[layer]}, self._weight_numel,
                                              self.mlp)
        return self._layers[layer]

    @property
    def kernel_types(self) -> StackTypes:  # type: ignore[override]
        """The (gate, up, down) types of a one-layer format's blobs."""
        (t,) = set(self.types.values())
        return t

    def describe(self) -> str:
        pairs = sorted(set(self.types.values()))
        def layers(t: StackTypes) -> str:
            n = sum(1 for v in self.types.values() if v == t)
            return f"{n} layer{'s' if n != 1 else ''}"

        per_layer = ("; ".join(f"{'/'.join(t)}: {layers(t)}" for t in pairs) if len(pairs) > 1
                     else "/".join(pairs[0]))
        return f"as stored in the GGUF ({per_layer})"

    def load(self, reader: CheckpointReader, layer: int, expert: int,
             out: torch.Tensor) -> None:
        at = reader.read_expert_blocks(layer, expert, out.numpy())  # straight into the row
        assert at == self._bytes(self.types[layer])[3], (layer, at)
        self._load_biases(reader, layer, expert, out)

    def pack(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
             out: torch.Tensor) -> None:
        raise ValueError(f"{self.name.upper()} experts are loaded as stored, not packed from "
                         "floats")

    def weights(self, blob: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [F, D], up [F, D], down [D, F]) of a one-layer format's blob, dequantized
        to `dtype`."""
        D, Fs, t = self.hidden_size, self.ffn_size, self.kernel_types
        g, u, d, _ = self._bytes(t)
        gate = dequantize(blob[:g], t[0]).to(dtype).view(Fs, D)
        up = dequantize(blob[g:g + u], t[1]).to(dtype).view(Fs, D)
        down = dequantize(blob[g + u:g + u + d], t[2]).to(dtype).view(D, Fs)
        return gate, up, down


class Fp8Format(_AsStored):
    """Experts kept as a Hugging Face FP8 checkpoint stores them: float8 e4m3 codes with an fp32
    scale per bo x bi block (`weight_scale_inv`; weight = code * scale). A blob is the pair's
    gate, up and down codes (F x D, F x D, D x F: one byte a weight), then their scales in the
    same order, row-major blocks. The C strata_moe reads the codes in place (converted to fp32
    in registers, fp32 products, one FMA by the block's scale per block), the Triton gpu_moe
    too (code times scale in registers); forward() is the torch reference (dequantize, then
    the MLP), where no kernel takes the codes."""

    def __init__(self, hidden_size: int, ffn_size: int, block: tuple[int, int] = (128, 128),
                 mlp: ExpertMlp = SWIGLU):
        bo, bi = block
        if hidden_size % 8 or ffn_size % 8 or bi % 8:
            raise ValueError(f"FP8 experts need rows and scale blocks of multiples of 8 weights "
                             f"(hidden {hidden_size}, FFN {ffn_size}, block {bo}x{bi})")
        self.hidden_size, self.ffn_size, self.kernel_block = hidden_size, ffn_size, (bo, bi)
        D, Fs = hidden_size, ffn_size
        self.scales = (-(-Fs // bo) * -(-D // bi),) * 2 + (-(-D // bo) * -(-Fs // bi),)
        self.numel = 3 * D * Fs + 4 * sum(self.scales)
        self.name, self.dtype, self.read_dtype = "fp8", torch.uint8, torch.uint8
        self.kernel_weights = "fp8"
        self._with_mlp(mlp)

    def describe(self) -> str:
        bo, bi = self.kernel_block  # type: ignore[misc]
        return f"float8 e4m3 as stored in the checkpoint ({bo}x{bi} block scales)"

    def load(self, reader: CheckpointReader, layer: int, expert: int,
             out: torch.Tensor) -> None:
        at = reader.read_expert_fp8(layer, expert, out.numpy())  # straight into the row
        assert at == (self.numel if self.bias_at < 0 else self.bias_at), (layer, expert, at)
        self._load_biases(reader, layer, expert, out)

    def pack(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
             out: torch.Tensor) -> None:
        raise ValueError("FP8 experts are loaded as stored, not packed from floats")

    def weights(self, blob: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [F, D], up [F, D], down [D, F]) of a blob, dequantized to `dtype`."""
        D, Fs = self.hidden_size, self.ffn_size
        block = self.kernel_block
        assert block is not None
        n = D * Fs
        scales = blob[3 * n:3 * n + 4 * sum(self.scales)].view(torch.float32)
        out, at = [], 0
        for i, (rows, cols) in enumerate(((Fs, D), (Fs, D), (D, Fs))):
            codes = blob[i * n:(i + 1) * n].view(torch.float8_e4m3fn).view(rows, cols)
            s = scales[at:at + self.scales[i]].view(-(-rows // block[0]), -(-cols // block[1]))
            at += self.scales[i]
            out.append(fp8_values(codes, s, block).to(dtype))
        return out[0], out[1], out[2]


def expert_format(hidden_size: int, ffn_size: int, dtype: torch.dtype,
                  expert_dtype: str = "auto", stored: dict[int, StackTypes] | None = None,
                  fp8_block: tuple[int, int] = (128, 128),
                  mlp: ExpertMlp = SWIGLU, inputs_major: bool = False) -> ExpertFormat:
    """The format of `--expert-dtype` for weights served in `dtype`: auto keeps the experts
    as they are stored — GGUF block types (`stored`: each MoE layer's stack types, from
    CheckpointReader.expert_storage) as their bytes, else fp32 or bf16 (`inputs_major`: in
    the [in, out] layout) — and int8 / int4 quantize them. `mlp`: what the model's experts
    compute (activation, biases)."""
    if expert_dtype == "auto" and stored and all(
            t == (FP8_STORED,) * 3 for t in stored.values()):
        return Fp8Format(hidden_size, ffn_size, fp8_block, mlp)
    if expert_dtype == "auto" and stored:
        return BlockFormat(hidden_size, ffn_size, stored, mlp=mlp)
    if expert_dtype == "auto":
        return DenseFormat(hidden_size, ffn_size, dtype, mlp, inputs_major)
    if expert_dtype not in QUANT_SPECS:
        raise ValueError(f"unknown expert dtype {expert_dtype!r} (choose from {EXPERT_DTYPES})")
    return QuantFormat(hidden_size, ffn_size, expert_dtype, mlp)


DEVICE_KERNEL_WEIGHTS = ("fp32", "bf16", "blocks", "fp8")  # what the Triton gpu_moe reads


def device_kernel(fmt: ExpertFormat, device: torch.device) -> ModuleType | None:
    """The Triton MoE kernels when they run these experts (a format they take, on a CUDA
    device, Triton installed), else None."""
    if device.type != "cuda" or fmt.kernel_weights not in DEVICE_KERNEL_WEIGHTS:
        return None
    try:
        from services.engine.kernels import gpu_moe
    except ImportError as e:
        log.warning("Triton is not importable (%s): routed experts run as torch ops per expert "
                    "and host-placed misses on the CPU; install triton for the device kernel", e)
        return None
    return gpu_moe
