"""Read a Hugging Face safetensors checkpoint: one or many shards, with or without an index.

Expert weights come in two spellings, both read here:
  per expert  model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight   [F, D] [F, D] [D, F]
  fused 3-D   model.layers.L.mlp.experts.gate_up_proj [E, 2F, D], .down_proj [E, D, F]
              (gpt_oss: gate_up_proj [E, D, 2F] with gate and up columns alternating,
              down_proj [E, F, D], and their biases gate_up_proj_bias [E, 2F], down_proj_bias)
  MXFP4       gpt-oss as released: {gate_up,down}_proj_blocks [E, rows, in / 32, 16] and
              _scales [E, rows, in / 32], rows of OpenAI's MXFP4 blocks, kept as stored
              (re-laid into GGUF's MXFP4 block, bit for bit: blocks.mxfp4_from_openai)
(`transformers` 5 holds the fused form in memory and converts to per-expert keys on save.)
Other families rename the block and the projections (WeightNames: mixtral's
block_sparse_moe.experts.E.{w1,w3,w2}); the reader is told which names its checkpoint uses.
Tensors are converted to the dtype asked for (model/dtypes.py picks it) on the CPU.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from services.engine.model.blocks import FP8_STORED, dequantize, fp8_values, mxfp4_from_openai
from services.engine.model.config import CheckpointError, ModelConfig, WeightNames, find_gguf
from services.engine.model.families import parse_config
from services.engine.model.gguf_reader import GGUFCheckpoint, load_gguf_config

EXPERTS = "model.layers.{layer}.{moe}.experts"
LANGUAGE_MODEL = "model.language_model."  # a multimodal checkpoint's text model
NOT_LOADED = ("model.visual.", "mtp.")  # a vision tower, a multi-token-prediction head
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                      "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn,
                      "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
                      "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}


def open_checkpoint(model_dir: Path, names: WeightNames | None = None) -> CheckpointReader:
    """A safetensors checkpoint directory, or a GGUF file (or a directory holding one) read
    under the same Hugging Face names (model/gguf_reader.py)."""
    if (gguf_path := find_gguf(model_dir)) is not None:
        return GGUFCheckpoint(gguf_path, names)  # type: ignore[return-value]  # same interface
    return CheckpointReader(model_dir, names)


def checkpoint_bytes(model: Path) -> int:
    """Bytes of a checkpoint on disk: a GGUF file, or a directory's weight files."""
    model = Path(model)
    if model.is_file():
        return model.stat().st_size
    return sum(f.stat().st_size for f in model.glob("*.safetensors"))


def load_model_config(model_dir: Path) -> ModelConfig:
    """config.json of a checkpoint directory, or a GGUF file's metadata (model/gguf_reader.py)."""
    if (gguf_path := find_gguf(model_dir)) is not None:
        return load_gguf_config(gguf_path)
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir} has no config.json")
    return parse_config(json.loads(path.read_text()))


class CheckpointReader:
    """Name -> tensor access over all safetensors shards of one checkpoint directory."""

    def __init__(self, model_dir: Path, names: WeightNames | None = None):
        self.model_dir = Path(model_dir)
        self.weight_names = names or WeightNames()
        files = self._shard_files()
        self._handles = {f: safe_open(str(self.model_dir / f), framework="pt") for f in files}
        self._file_of: dict[str, str] = {}
        for f, handle in self._handles.items():
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                self._file_of[name] = f
        # A multimodal checkpoint (Qwen3.5) keeps its language model under
        # model.language_model.*: read under the model.* names every family uses; the vision
        # tower (model.visual.*) is not loaded.
        self._stored: dict[str, str] = {}  # name as read -> name in the file
        for name in [n for n in self._file_of if n.startswith(LANGUAGE_MODEL)]:
            logical = "model." + name[len(LANGUAGE_MODEL):]
            self._file_of[logical] = self._file_of.pop(name)
            self._stored[logical] = name
        self._headers: dict[str, tuple[int, dict[str, Any]]] = {}  # file -> (data start, header)

    def _shard_files(self) -> list[str]:
        index = self.model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            # mtp.safetensors holds a draft head (services/engine/spec/mtp_head.py), not the model
            files = sorted(p.name for p in self.model_dir.glob("*.safetensors")
                           if p.name != "mtp.safetensors")
        if not files:
            raise CheckpointError(f"{self.model_dir} has no *.safetensors files")
        missing = [f for f in files if not (self.model_dir / f).is_file()]
        if missing:
            raise CheckpointError(f"{self.model_dir} lacks shard(s) {', '.join(missing)}")
        return files

    def renamed(self, rename: Callable[[str], str | None]) -> CheckpointReader:
        """The same files read under other names: rename(name) is the name a tensor reads as,
        or None to leave it out (a checkpoint's MTP layer read as a one-layer model, say)."""
        view = copy.copy(self)
        view._file_of, view._stored = {}, {}
        for name, f in self._file_of.items():
            if (new := rename(name)) is not None:
                view._file_of[new] = f
                view._stored[new] = self._stored.get(name, name)
        return view

    @property
    def names(self) -> list[str]:
        return sorted(self._file_of)

    @property
    def num_files(self) -> int:
        return len(self._handles)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def _slice(self, name: str):
        if name not in self._file_of:
            raise CheckpointError(f"checkpoint {self.model_dir.name} lacks tensor {name!r}")
        return self._handles[self._file_of[name]].get_slice(self._stored.get(name, name))

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def stored_dtype(self, name: str) -> str:
        """The tensor's dtype as the file stores it (safetensors' name: F32, BF16, F16, ...)."""
        return self._slice(name).get_dtype()

    def get(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        self._slice(name)  # raises a CheckpointError naming a missing tensor
        tensor = self._handles[self._file_of[name]].get_tensor(self._stored.get(name, name))
        return self._values(name, tensor).to(dtype)

    @functools.cached_property
    def fp8_block(self) -> tuple[int, int]:
        """config.json's quantization_config.weight_block_size (FP8 checkpoints with block
        scales: DeepSeek-V3, Kimi-K2, MiniMax-M2, Qwen3-*-FP8); [128, 128] when unstated."""
        path = self.model_dir / "config.json"
        q = json.loads(path.read_text()).get("quantization_config") or {} if path.is_file() else {}
        block = q.get("weight_block_size") or [128, 128]
        return int(block[0]), int(block[1])

    def _values(self, name: str, t: torch.Tensor, index: int | None = None) -> torch.Tensor:
        """A stored tensor's values: an FP8 weight times its block scales (`<name>_scale_inv`,
        one per weight_block_size block, as DeepSeek's weight_dequant multiplies them; slab
        `index` of a stacked one), in fp32; anything else as it is."""
        if t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            return t
        scale_name = f"{name}_scale_inv"
        if scale_name not in self:
            raise CheckpointError(f"{name} is stored in {t.dtype} without {scale_name}: only "
                                  "FP8 weights with block scales are read")
        return fp8_values(t, self._read(scale_name, index), self.fp8_block)

    def fp8(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A 2-D e4m3 weight with its block scales as stored: (codes uint8 [N, K], scales fp32
        [ceil(N / bo), ceil(K / bi)]); None for anything else."""
        if (self.stored_dtype(name) != "F8_E4M3" or f"{name}_scale_inv" not in self
                or len(self.shape(name)) != 2):
            return None
        codes = self._read(name).view(torch.uint8)  # a positioned read, not the mapping
        return codes, self._read(f"{name}_scale_inv").float().contiguous()

    def blocks(self, name: str) -> tuple[str, np.ndarray]:
        """A tensor's stored block type and bytes (GGUF files only: safetensors hold floats)."""
        raise CheckpointError(f"{self.model_dir.name} stores {name} as floats, not blocks")

    def _mxfp4_prefix(self, layer: int) -> str | None:
        """The experts' prefix of a layer stored in OpenAI's MXFP4 blocks (gpt-oss), or None."""
        prefix = EXPERTS.format(layer=layer, moe=self.weight_names.moe)
        stacks = [f"{prefix}.{p}_proj_{part}" for p in ("gate_up", "down")
                  for part in ("blocks", "scales")]
        return prefix if all(name in self for name in stacks) else None

    def read_expert_blocks(self, layer: int, expert: int, out: np.ndarray) -> int:
        """One pair's stored MXFP4 blocks into `out` as cache/formats.py's BlockFormat holds
        them: gate rows, up rows, down rows of GGUF MXFP4 blocks (gpt-oss's safetensors; the
        gate and up rows of the fused stack alternate). Returns the bytes written."""
        prefix = self._mxfp4_prefix(layer)
        if prefix is None:
            raise CheckpointError(f"{self.model_dir.name} stores experts as floats, not blocks")
        gu = mxfp4_from_openai(self._read(f"{prefix}.gate_up_proj_blocks", expert).numpy(),
                               self._read(f"{prefix}.gate_up_proj_scales", expert).numpy())
        down = mxfp4_from_openai(self._read(f"{prefix}.down_proj_blocks", expert).numpy(),
                                 self._read(f"{prefix}.down_proj_scales", expert).numpy())
        half = gu.shape[0] // 2
        gate, up = ((gu[0::2], gu[1::2]) if self.weight_names.gate_up_interleaved
                    else (gu[:half], gu[half:]))
        at = 0
        for rows in (gate, up, down):
            out[at:at + rows.size] = rows.reshape(-1)
            at += rows.size
        return at

    def _expert_names(self, layer: int, expert: int) -> list[tuple[str, int | None]]:
        """The stored (name, slab index) of one pair's gate, up and down: per-expert tensors,
        or slabs of fused stacks (gate_up split by the caller)."""
        n = self.weight_names
        prefix = EXPERTS.format(layer=layer, moe=n.moe)
        if f"{prefix}.{expert}.{n.gate}.weight" in self:
            return [(f"{prefix}.{expert}.{p}.weight", None) for p in (n.gate, n.up, n.down)]
        fused = [next((c for c in (f"{prefix}.{s}", f"{prefix}.{s}.weight") if c in self), "")
                 for s in ("gate_up_proj", "down_proj")]
        return [(fused[0], expert), (fused[1], expert)]

    def read_expert_fp8(self, layer: int, expert: int, out: np.ndarray) -> int:
        """One FP8 pair as stored into `out` (cache/formats.py's Fp8Format): the gate, up and
        down codes, then their block scales, by positioned reads. Returns the bytes written."""
        parts = self._expert_names(layer, expert)
        if len(parts) != 3:
            raise CheckpointError(f"{self.model_dir.name}: FP8 experts are read as stored only "
                                  "from per-expert tensors")
        at = 0
        for name, index in parts:  # the codes, straight into the row
            at += self._read_into(name, index, out[at:])
        for name, index in parts:  # the fp32 scales (converted when stored otherwise)
            scale = f"{name}_scale_inv"
            if self._entry(scale, index)[3] == torch.float32:
                at += self._read_into(scale, index, out[at:])
                continue
            raw = self._read(scale, index).float().reshape(-1).view(torch.uint8).numpy()
            out[at:at + raw.size] = raw
            at += raw.size
        return at

    def expert_storage(self) -> dict[int, tuple[str, str, str]] | None:
        """Each MoE layer's (gate, up, down) expert types, for a format that keeps them as
        stored: FP8 checkpoints with block scales (per-expert tensors), (FP8_STORED,) * 3
        per layer; gpt-oss's MXFP4 stacks, ("MXFP4",) * 3; plain floats: None (GGUF files:
        model/gguf_reader.py)."""
        config_path = self.model_dir / "config.json"
        if not config_path.is_file():
            return None
        layers = sorted({int(name.split(".")[2]) for name in self._file_of
                         if ".experts." in name and name.startswith("model.layers.")})
        if layers and all(self._mxfp4_prefix(layer) for layer in layers):
            return {layer: ("MXFP4",) * 3 for layer in layers}
        out = {}
        for layer in layers:
            parts = self._expert_names(layer, 0)
            if len(parts) != 3 or any(self.stored_dtype(name) != "F8_E4M3"
                                      or f"{name}_scale_inv" not in self for name, _ in parts):
                return None
            out[layer] = (FP8_STORED,) * 3
        return out or None

    def _entry(self, name: str, index: int | None = None
               ) -> tuple[str, int, int, torch.dtype, list[int]]:
        """(shard, file offset, bytes, dtype, shape) of a tensor or its `index`-th slab along
        dim 0, from the shard's safetensors header (read once)."""
        f = self._file_of[name]
        if f not in self._headers:
            with open(self.model_dir / f, "rb") as fh:
                (size,) = struct.unpack("<Q", fh.read(8))
                self._headers[f] = (8 + size, json.loads(fh.read(size)))
        start, header = self._headers[f]
        entry = header[self._stored.get(name, name)]
        shape, (begin, end) = list(entry["shape"]), entry["data_offsets"]
        if index is not None:
            slab = (end - begin) // shape[0]
            begin, end, shape = begin + index * slab, begin + (index + 1) * slab, shape[1:]
        return f, start + begin, end - begin, SAFETENSORS_DTYPES[entry["dtype"]], shape

    def _read_into(self, name: str, index: int | None, out: np.ndarray) -> int:
        """A tensor's (or slab's) stored bytes into the uint8 buffer `out` with one positioned
        read from its shard, not through safetensors' mapping: loading every expert of a
        checkpoint leaves only the host store resident, the shards' pages reclaimable page
        cache. Returns the bytes read."""
        f, offset, size, _, _ = self._entry(name, index)
        fd = os.open(self.model_dir / f, os.O_RDONLY)
        try:
            got = os.preadv(fd, [memoryview(out[:size])], offset)
        finally:
            os.close(fd)
        if got != size:
            raise CheckpointError(f"{f}: short read of {name} ({got} of {size} bytes)")
        return size

    def _read(self, name: str, index: int | None = None) -> torch.Tensor:
        """A tensor (or its `index`-th slab along dim 0) by _read_into, as stored."""
        _, _, size, dtype, shape = self._entry(name, index)
        out = torch.empty(size, dtype=torch.uint8)
        self._read_into(name, index, out.numpy())
        return out.view(dtype).view(shape)

    def expert_weights(
        self,
        layer: int,
        expert: int,
        hidden_size: int,
        ffn_size: int,
        dtype: torch.dtype = torch.float32,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [F, D], up [F, D], down [D, F]) of one pair, whichever spelling is stored."""
        n = self.weight_names
        prefix = EXPERTS.format(layer=layer, moe=n.moe)
        per_expert = f"{prefix}.{expert}.{n.gate}.weight"
        if self._mxfp4_prefix(layer) is not None:  # MXFP4 stacks: their reference values
            cut = ffn_size * hidden_size // 32 * 17  # one matrix's blocks
            rows = np.empty(3 * cut, dtype=np.uint8)
            self.read_expert_blocks(layer, expert, rows)
            parts = torch.from_numpy(rows).split([cut, cut, cut])
            return (dequantize(parts[0], "MXFP4").view(ffn_size, hidden_size).to(dtype),
                    dequantize(parts[1], "MXFP4").view(ffn_size, hidden_size).to(dtype),
                    dequantize(parts[2], "MXFP4").view(hidden_size, ffn_size).to(dtype))
        if per_expert in self:
            return tuple(
                self._values(name, self._read(name)).to(dtype)  # type: ignore[misc]
                for name in (f"{prefix}.{expert}.{p}.weight" for p in (n.gate, n.up, n.down))
            )
        fused_gu = next(
            (n for n in (f"{prefix}.gate_up_proj", f"{prefix}.gate_up_proj.weight") if n in self),
            None,
        )
        fused_down = next(
            (n for n in (f"{prefix}.down_proj", f"{prefix}.down_proj.weight") if n in self), None
        )
        if fused_gu is None or fused_down is None:
            raise CheckpointError(
                f"checkpoint {self.model_dir.name} has no weights for expert "
                f"{expert} of layer {layer} (neither per-expert nor fused keys)"
            )
        gate_up = self._values(fused_gu, self._read(fused_gu, expert), expert).to(dtype)
        if n.gate_up_interleaved:  # gpt_oss, [D, 2F] gate, up, gate, up ... and down [F, D]
            # (by layout, not shape: gpt-oss-120b's D and F are both 2880)
            down = self._values(fused_down, self._read(fused_down, expert), expert).to(dtype)
            return gate_up.t()[0::2], gate_up.t()[1::2], down.t()
        if gate_up.shape != (2 * ffn_size, hidden_size):  # some writers store [D, 2F]
            gate_up = gate_up.t()
        return (gate_up[:ffn_size], gate_up[ffn_size:],
                self._fused_down(fused_down, expert, hidden_size, ffn_size, dtype))

    def _fused_down(self, name: str, expert: int, hidden_size: int, ffn_size: int,
                    dtype: torch.dtype) -> torch.Tensor:
        """Slab `expert` of a fused down stack as [D, F] (stored [D, F] or [F, D])."""
        down = self._values(name, self._read(name, expert), expert).to(dtype)
        return down if down.shape == (hidden_size, ffn_size) else down.t()

    def expert_biases(self, layer: int, expert: int, hidden_size: int, ffn_size: int
                      ) -> torch.Tensor:
        """One pair's biases, fp32 [gate F | up F | down D] (cache/formats.py's blob tail):
        slabs of the fused gate_up_proj_bias [E, 2F] (gate and up alternating where the
        family interleaves them) and down_proj_bias [E, D]."""
        n = self.weight_names
        prefix = EXPERTS.format(layer=layer, moe=n.moe)
        gate_up = self._read(f"{prefix}.gate_up_proj_bias", expert).float()
        down = self._read(f"{prefix}.down_proj_bias", expert).float()
        assert gate_up.shape == (2 * ffn_size,) and down.shape == (hidden_size,)
        gate, up = ((gate_up[0::2], gate_up[1::2]) if n.gate_up_interleaved
                    else (gate_up[:ffn_size], gate_up[ffn_size:]))
        return torch.cat([gate, up, down])

    def fingerprint(self, config: ModelConfig) -> str:
        """Short hex sha256 over the canonical config and every tensor's name, shape and dtype."""
        h = hashlib.sha256(config.canonical_json().encode())
        for name in self.names:
            s = self._slice(name)
            h.update(f"\n{name}:{list(s.get_shape())}:{s.get_dtype()}".encode())
        return h.hexdigest()[:16]
