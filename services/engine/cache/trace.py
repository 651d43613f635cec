"""Routing traces (`--record-routing PATH`): every step's routed pairs, in the order the expert
cache saw them, so `strata cache replay` can drive the same residency code offline.

File format, version 2 (version 1 lacks kind 5), all little-endian:

    offset  size  field
         0     8  magic        b"STRATATR"
         8     4  u32 version  1
        12     4  u32 meta_len
        16  meta  JSON object: model fingerprint and shape, and the live cache's settings
                  (slots, policy, pinned_fraction, crf_lambda, admit_prefill, prefetch)
    then records, each an 8-byte head  u8 kind, 3 pad bytes, u32 num_entries
                  and num_entries entries of 8 bytes: u16 layer, u16 expert, u32 count

    kind 1 FILL     a pre-fill ranking, hottest first (count 0); residency restarts from it
    kind 2 DECODE   one layer of a decode step: distinct experts and tokens routed to each
    kind 3 PREFILL  the same for a prefill step
    kind 4 PREDICT  experts predicted for the next layer (next layer's router on this layer's
                    hidden state), recorded whether or not prefetch was on
    kind 5 MIXED    one layer of a continuous-batching step holding decode tokens and prefill
                    chunks: count = decode tokens | prefill tokens << 16

Traces do not depend on the cache's policy or size (outputs are exact whatever the cache does),
so one trace replays every policy and size. A record cut short at the end (the engine was
killed while writing) is dropped by the reader.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

log = logging.getLogger("strata.engine")

MAGIC = b"STRATATR"
VERSION = 2
READABLE_VERSIONS = (1, 2)
FILL, DECODE, PREFILL, PREDICT, MIXED = 1, 2, 3, 4, 5
KIND_NAMES = {FILL: "fill", DECODE: "decode", PREFILL: "prefill", PREDICT: "predict",
              MIXED: "mixed"}
ROUTED_KINDS = (DECODE, PREFILL, MIXED)
_HEAD = struct.Struct("<8sII")
_RECORD = struct.Struct("<B3xI")
ENTRY = np.dtype([("layer", "<u2"), ("expert", "<u2"), ("count", "<u4")])
assert _RECORD.size == 8 and ENTRY.itemsize == 8


class TraceError(ValueError):
    """A trace file that cannot be read."""


@dataclass(frozen=True)
class Record:
    kind: int
    entries: np.ndarray  # ENTRY [n]

    @property
    def layer(self) -> int:
        return int(self.entries["layer"][0]) if len(self.entries) else -1

    def pairs_and_counts(self) -> list[tuple[int, int]]:
        """(expert, count) of a single-layer record."""
        return list(zip(self.entries["expert"].tolist(), self.entries["count"].tolist(),
                        strict=True))

    def phase_counts(self) -> list[tuple[int, int, int]]:
        """(expert, decode tokens, prefill tokens) of a DECODE, PREFILL or MIXED record."""
        experts = self.entries["expert"].tolist()
        counts = self.entries["count"].astype(np.int64)
        if self.kind == MIXED:
            decode, prefill = counts & 0xFFFF, counts >> 16
        elif self.kind == DECODE:
            decode, prefill = counts, np.zeros_like(counts)
        else:
            decode, prefill = np.zeros_like(counts), counts
        return list(zip(experts, decode.tolist(), prefill.tolist(), strict=True))

    def pairs(self) -> list[tuple[int, int]]:
        return list(zip(self.entries["layer"].tolist(), self.entries["expert"].tolist(),
                        strict=True))


class TraceWriter:
    """Appends records to PATH (created or truncated at start); `flush()` between requests."""

    def __init__(self, path: str | Path, meta: dict[str, Any]):
        self.path = Path(path)
        self.num_records = 0
        self._file: BinaryIO = open(self.path, "wb")  # noqa: SIM115 (closed in close())
        raw = json.dumps(meta, sort_keys=True).encode()
        self._file.write(_HEAD.pack(MAGIC, VERSION, len(raw)) + raw)

    def layer_record(self, kind: int, layer: int, experts: Sequence[int],
                     counts: Sequence[int]) -> None:
        entries = np.empty(len(experts), dtype=ENTRY)
        entries["layer"] = layer
        entries["expert"] = experts
        entries["count"] = counts
        self._write(kind, entries)

    def mixed_record(self, layer: int, experts: Sequence[int], decode_counts: Sequence[int],
                     prefill_counts: Sequence[int]) -> None:
        assert max(prefill_counts, default=0) < 1 << 16 and max(decode_counts, default=0) < 1 << 16
        packed = [d | p << 16 for d, p in zip(decode_counts, prefill_counts, strict=True)]
        self.layer_record(MIXED, layer, experts, packed)

    def fill_record(self, pairs: Sequence[tuple[int, int]]) -> None:
        entries = np.zeros(len(pairs), dtype=ENTRY)
        if pairs:
            entries["layer"], entries["expert"] = np.asarray(pairs, dtype=np.int64).T
        self._write(FILL, entries)

    def _write(self, kind: int, entries: np.ndarray) -> None:
        self._file.write(_RECORD.pack(kind, len(entries)) + entries.tobytes())
        self.num_records += 1

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


@dataclass(frozen=True)
class Trace:
    meta: dict[str, Any]
    records: tuple[Record, ...]

    @classmethod
    def read(cls, path: str | Path) -> Trace:
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise TraceError(f"cannot read routing trace {path}: {exc.strerror}") from None
        return cls.from_bytes(data, source=str(path))

    @classmethod
    def from_bytes(cls, data: bytes, source: str = "<bytes>") -> Trace:
        if len(data) < _HEAD.size:
            raise TraceError(f"{source}: not a routing trace (too short)")
        magic, version, meta_len = _HEAD.unpack_from(data)
        if magic != MAGIC:
            raise TraceError(f"{source}: not a routing trace (magic {magic!r}, "
                             f"expected {MAGIC!r})")
        if version not in READABLE_VERSIONS:
            raise TraceError(f"{source}: trace format version {version}; this build reads "
                             f"versions {READABLE_VERSIONS}")
        try:
            meta = json.loads(data[_HEAD.size : _HEAD.size + meta_len])
        except ValueError as exc:
            raise TraceError(f"{source}: unreadable metadata ({exc})") from None
        return cls(meta, tuple(_records(data, _HEAD.size + meta_len, source)))

    @property
    def num_layers(self) -> int:
        return int(self.meta["num_layers"])

    @property
    def num_experts(self) -> int:
        return int(self.meta["num_experts"])

    @property
    def total_pairs(self) -> int:
        return int(self.meta.get("total_pairs", self.num_layers * self.num_experts))

    def routing_counts(self, kinds: tuple[int, ...] = (DECODE, PREFILL)) -> np.ndarray:
        """Tokens routed to each pair [L, E] over the records of `kinds`."""
        counts = np.zeros((self.num_layers, self.num_experts), dtype=np.int64)
        for r in self.records:
            if r.kind in kinds:
                np.add.at(counts, (r.entries["layer"].astype(np.int64),
                                   r.entries["expert"].astype(np.int64)),
                          r.entries["count"].astype(np.int64))
        return counts

    def first_fill(self) -> list[tuple[int, int]] | None:
        return next((r.pairs() for r in self.records if r.kind == FILL), None)


def _records(data: bytes, offset: int, source: str) -> Iterator[Record]:
    while offset < len(data):
        if offset + _RECORD.size > len(data):
            log.warning("%s: dropped a truncated record at the end", source)
            return
        kind, n = _RECORD.unpack_from(data, offset)
        if kind not in KIND_NAMES:
            raise TraceError(f"{source}: unknown record kind {kind} at byte {offset}")
        offset += _RECORD.size
        end = offset + n * ENTRY.itemsize
        if end > len(data):
            log.warning("%s: dropped a truncated record at the end", source)
            return
        yield Record(kind, np.frombuffer(data, dtype=ENTRY, count=n, offset=offset))
        offset = end
