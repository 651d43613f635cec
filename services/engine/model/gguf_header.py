"""A GGUF file's header — its metadata and its tensor table — parsed in one pass.

gguf-py's `GGUFReader` builds a numpy array for every metadata element by slicing an
`np.memmap`, whose Python-level slicing hooks run per element: the two 151,936-entry string
arrays of a Qwen vocabulary (tokens and merges) took 12-20 s to parse on a 2-core host, at
every load. This reads the same header with `struct` over the file's mapping and gives what
the GGUF checkpoint reader uses:

    fields   {key: value}: ints, floats, bools, str, or lists of them (gguf-py's
             ReaderField.contents() of each)
    tensors  gguf-py's ReaderTensor per tensor, its `data` a read-only view of the mapping
             shaped as gguf-py shapes it (elements for float/int types, block bytes per row
             for quantized ones)

Little-endian files only (what llama.cpp writes on every platform it runs on).
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.gguf_reader import ReaderTensor
from gguf.quants import quant_shape_to_byte_shape

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# value type -> (struct format, size) of the GGUF scalar types
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
            6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
# tensor types whose data is elements (gguf-py's shapes); every other type is block bytes
_ELEMENTS = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
             GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
             GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
             GGMLQuantizationType.I64: np.int64}


class GGUFHeader:
    def __init__(self, path: str | Path):
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._map
        if buf[:4] != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        version, num_tensors, num_fields = struct.unpack_from("<IQQ", buf, 4)
        if version & 0xFFFF == 0:
            raise ValueError("a big-endian GGUF file (only little-endian ones are read)")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (versions 2 and 3 are read)")
        self.version = version
        self._at = 24
        self.fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._string()
            if key in self.fields:
                raise ValueError(f"duplicate metadata key {key!r}")
            (kind,) = self._unpack("<I", 4)
            self.fields[key] = self._value(kind)
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            (num_dims,) = self._unpack("<I", 4)
            dims = struct.unpack_from(f"<{num_dims}Q", buf, self._at)
            self._at += 8 * num_dims
            raw_type, offset = self._unpack("<IQ", 12)
            infos.append((name, dims, GGMLQuantizationType(raw_type), offset))
        alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"invalid alignment {alignment}: must be a power of two")
        self.data_offset = -(-self._at // alignment) * alignment
        self.tensors = [self._tensor(*info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("duplicate tensor names")

    def _unpack(self, fmt: str, size: int) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self._map, self._at)
        self._at += size
        return values

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._map, self._at)
        start = self._at + 8
        self._at = start + n
        if self._at > len(self._map):
            raise ValueError("a string runs past the end of the file")
        return self._map[start:self._at].decode("utf-8")

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind in _SCALARS:
            fmt, size = _SCALARS[kind]
            return self._unpack(fmt, size)[0]
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item_kind, n = self._unpack("<IQ", 12)
        if item_kind == _STRING:
            return [self._string() for _ in range(n)]
        if item_kind not in _NUMPY:
            raise ValueError(f"metadata arrays of type {item_kind} are not read")
        items = np.frombuffer(self._map, dtype=_NUMPY[item_kind], count=n, offset=self._at)
        self._at += items.nbytes
        return items.tolist()

    def _tensor(self, name: str, dims: tuple[int, ...], kind: GGMLQuantizationType,
                offset: int) -> ReaderTensor:
        num = int(np.prod(dims))
        block_size, type_size = GGML_QUANT_SIZES[kind]
        num_bytes = num * type_size // block_size
        at = self.data_offset + offset
        shape = tuple(reversed(dims))
        if at + num_bytes > len(self._map):
            raise ValueError(f"tensor {name} runs past the end of the file")
        if kind in _ELEMENTS:
            data = np.frombuffer(self._map, dtype=_ELEMENTS[kind], count=num, offset=at)
        else:
            data = np.frombuffer(self._map, dtype=np.uint8, count=num_bytes, offset=at)
            shape = quant_shape_to_byte_shape(shape, kind)
        return ReaderTensor(name=name, tensor_type=kind, shape=np.array(dims, dtype=np.uint64),
                            n_elements=num, n_bytes=num_bytes, data_offset=at,
                            data=data.reshape(shape), field=None)  # type: ignore[arg-type]
