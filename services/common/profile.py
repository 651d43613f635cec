"""The expert profile: (layer, expert) pairs ranked by routing frequency, as `expert-profile.bin`.

The engine pre-fills its cache with the hottest `slots` pairs; the cache manager ranks pairs from
it when no routing counts are known yet. Both read and write through this module.

File format, version 2 (version 1 lacks the decode counts), all little-endian:

    offset  size  field
         0     8  magic            b"STRATAPF"
         8     4  u32 version      1 or 2
        12    16  fingerprint      model fingerprint, ASCII (hex), NUL-padded; first 16 chars
        28     4  u32 num_layers
        32     4  u32 num_experts
        36     4  u32 num_pairs      <= num_layers * num_experts
        40     8  u64 built_for_slots  slots of the cache it was built for (0 = unknown)
        48        num_pairs records, hottest first:
                  version 1 (12 bytes): u16 layer, u16 expert, u64 count
                  version 2 (20 bytes): u16 layer, u16 expert, u64 count, u64 decode_count
                  (count descending; equal counts in (layer, expert) order)

`count` is every routed token (prompt and decode), which ranks the pairs; `decode_count` is the
decode tokens alone, the routing the decode hit rate is measured on (the capacity planner's hit
rate comes from it). A profile without decode counts is written as version 1, so files that
older builds wrote and read stay unchanged; both versions are read.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"STRATAPF"
VERSION = 2  # written when the profile has decode counts; otherwise version 1
READABLE_VERSIONS = (1, 2)
FINGERPRINT_CHARS = 16
_HEADER = struct.Struct("<8sI16sIIIQ")
_RECORD_V1 = np.dtype([("layer", "<u2"), ("expert", "<u2"), ("count", "<u8")])
_RECORD_V2 = np.dtype([("layer", "<u2"), ("expert", "<u2"), ("count", "<u8"),
                       ("decode_count", "<u8")])
_RECORDS = {1: _RECORD_V1, 2: _RECORD_V2}
assert _HEADER.size == 48 and _RECORD_V1.itemsize == 12 and _RECORD_V2.itemsize == 20


class ProfileError(ValueError):
    """A profile file that cannot be used: unreadable, corrupt, or for another model."""


def fingerprint_key(fingerprint: str) -> str:
    """The part of a model fingerprint a profile stores and compares: its first 16 chars."""
    return fingerprint[:FINGERPRINT_CHARS]


def rank_pairs(counts: np.ndarray, base_order: np.ndarray | None = None) -> np.ndarray:
    """Flat pair indices (layer * E + expert), hottest first.

    counts: [L, E]. Equal counts keep `base_order` (default: layer order), so rankings are
    deterministic and a partial count table refines, rather than replaces, an earlier ranking.
    """
    flat = np.asarray(counts, dtype=np.int64).reshape(-1)  # [L*E]
    if base_order is None:
        base_order = np.arange(flat.size)
    # A stable sort on -count keeps base_order among equal counts.
    return base_order[np.argsort(-flat[base_order], kind="stable")]


@dataclass(frozen=True)
class Profile:
    fingerprint: str
    num_layers: int
    num_experts: int
    ranked: tuple[tuple[int, int, int], ...]  # (layer, expert, count), hottest first
    built_for_slots: int = 0
    # Decode-phase routed tokens of each ranked pair, in `ranked` order; None: not recorded
    # (a version 1 file, or counts that were never split by phase).
    decode_counts: tuple[int, ...] | None = None

    @property
    def total_pairs(self) -> int:
        return self.num_layers * self.num_experts

    @classmethod
    def from_counts(cls, counts: np.ndarray, fingerprint: str, built_for_slots: int = 0,
                    decode_counts: np.ndarray | None = None) -> Profile:
        """Rank every pair of a [L, E] count table (zero counts included, last); `decode_counts`
        [L, E], when given, are the decode-phase share of `counts`, kept alongside."""
        counts = np.asarray(counts)
        if counts.ndim != 2:
            raise ValueError(f"counts must be [num_layers, num_experts], got shape {counts.shape}")
        if counts.size and counts.min() < 0:
            raise ValueError("counts must be >= 0")
        num_layers, num_experts = counts.shape
        order = rank_pairs(counts)
        flat = counts.reshape(-1)
        ranked = tuple((int(i) // num_experts, int(i) % num_experts, int(flat[i])) for i in order)
        decode = None
        if decode_counts is not None:
            decode_flat = np.asarray(decode_counts).reshape(-1)  # [L*E]
            if decode_flat.size != flat.size:
                raise ValueError(f"decode_counts must have the shape of counts {counts.shape}")
            if decode_flat.size and decode_flat.min() < 0:
                raise ValueError("decode_counts must be >= 0")
            decode = tuple(int(decode_flat[i]) for i in order)
        profile = cls(fingerprint_key(fingerprint), num_layers, num_experts, ranked,
                      built_for_slots, decode)
        profile._check()
        return profile

    def top_pairs(self, n: int) -> list[tuple[int, int]]:
        """The `n` hottest (layer, expert) pairs."""
        return [(layer, expert) for layer, expert, _ in self.ranked[:n]]

    def order(self) -> np.ndarray:
        """Flat pair indices (layer * E + expert), hottest first; pairs missing from the file
        follow in layer order."""
        listed = np.array([layer * self.num_experts + expert for layer, expert, _ in self.ranked],
                          dtype=np.int64)
        missing = np.setdiff1d(np.arange(self.total_pairs), listed, assume_unique=True)
        return np.concatenate([listed, missing])

    def counts(self) -> np.ndarray:
        """The count table [L, E] (0 for pairs the file does not list)."""
        table = np.zeros((self.num_layers, self.num_experts), dtype=np.int64)
        for layer, expert, count in self.ranked:
            table[layer, expert] = count
        return table

    def decode_table(self) -> np.ndarray | None:
        """The decode-phase count table [L, E] (0 for unlisted pairs); None if not recorded."""
        if self.decode_counts is None:
            return None
        table = np.zeros((self.num_layers, self.num_experts), dtype=np.int64)
        for (layer, expert, _), count in zip(self.ranked, self.decode_counts, strict=True):
            table[layer, expert] = count
        return table

    def validate(self, fingerprint: str, num_layers: int, num_experts: int) -> None:
        """Raise ProfileError unless this profile was built for the given model."""
        problems = []
        if self.fingerprint != fingerprint_key(fingerprint):
            problems.append(f"fingerprint {self.fingerprint!r} != {fingerprint_key(fingerprint)!r}")
        if (self.num_layers, self.num_experts) != (num_layers, num_experts):
            problems.append(f"shape {self.num_layers}x{self.num_experts} != "
                            f"{num_layers}x{num_experts} (layers x experts)")
        if problems:
            raise ProfileError("expert profile is for another model: " + "; ".join(problems)
                               + " — rebuild it for this checkpoint or drop it")

    def _check(self) -> None:
        try:
            self.fingerprint.encode("ascii")
        except UnicodeEncodeError:
            raise ProfileError(f"fingerprint must be ASCII: {self.fingerprint!r}") from None
        if not (0 < self.num_layers <= 0xFFFF + 1 and 0 < self.num_experts <= 0xFFFF + 1):
            raise ProfileError(f"shape {self.num_layers}x{self.num_experts} out of range "
                               "(1..65536 layers and experts)")
        if len(self.ranked) > self.total_pairs:
            raise ProfileError(f"{len(self.ranked)} pairs listed but the model has only "
                               f"{self.total_pairs}")
        if self.decode_counts is not None and len(self.decode_counts) != len(self.ranked):
            raise ProfileError(f"{len(self.decode_counts)} decode counts for "
                               f"{len(self.ranked)} ranked pairs")

    def write(self, path: str | Path) -> None:
        """Write atomically: a temporary file in the same directory, then rename."""
        self._check()
        path = Path(path)
        records = np.array(self.ranked, dtype=np.int64).reshape(-1, 3)
        version = 1 if self.decode_counts is None else 2
        table = np.empty(len(self.ranked), dtype=_RECORDS[version])
        table["layer"], table["expert"], table["count"] = records.T
        if self.decode_counts is not None:
            table["decode_count"] = np.array(self.decode_counts, dtype=np.int64)
        header = _HEADER.pack(MAGIC, version, self.fingerprint.encode("ascii"), self.num_layers,
                              self.num_experts, len(self.ranked), self.built_for_slots)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(table.tobytes())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    @classmethod
    def read(cls, path: str | Path) -> Profile:
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise ProfileError(f"cannot read expert profile {path}: {exc.strerror}") from None
        return cls.from_bytes(data, source=str(path))

    @classmethod
    def from_bytes(cls, data: bytes, source: str = "<bytes>") -> Profile:
        if len(data) < _HEADER.size:
            raise ProfileError(f"{source}: truncated header ({len(data)} of {_HEADER.size} bytes)")
        magic, version, raw_fp, num_layers, num_experts, num_pairs, built_for_slots = (
            _HEADER.unpack_from(data))
        if magic != MAGIC:
            raise ProfileError(f"{source}: not an expert profile (magic {magic!r}, "
                               f"expected {MAGIC!r})")
        if version not in READABLE_VERSIONS:
            raise ProfileError(f"{source}: profile format version {version}; this build reads "
                               f"versions {READABLE_VERSIONS}")
        record = _RECORDS[version]
        expected = _HEADER.size + num_pairs * record.itemsize
        if len(data) != expected:
            raise ProfileError(f"{source}: {len(data)} bytes, expected {expected} for "
                               f"{num_pairs} pairs (truncated or corrupt)")
        if num_pairs > num_layers * num_experts:
            raise ProfileError(f"{source}: {num_pairs} pairs for a {num_layers}x{num_experts} "
                               "model")
        table = np.frombuffer(data, dtype=record, offset=_HEADER.size, count=num_pairs)
        layers = table["layer"].astype(np.int64)
        experts = table["expert"].astype(np.int64)
        counts = table["count"].astype(np.uint64)
        if num_pairs and (layers.max() >= num_layers or experts.max() >= num_experts):
            raise ProfileError(f"{source}: a pair lies outside the {num_layers}x{num_experts} "
                               "model")
        if np.unique(layers * num_experts + experts).size != num_pairs:
            raise ProfileError(f"{source}: a pair is listed twice")
        if num_pairs > 1 and np.any(counts[1:] > counts[:-1]):
            raise ProfileError(f"{source}: pairs are not ranked by count")
        try:
            fingerprint = raw_fp.rstrip(b"\0").decode("ascii")
        except UnicodeDecodeError:
            raise ProfileError(f"{source}: fingerprint is not ASCII: {raw_fp!r}") from None
        ranked = tuple(zip(layers.tolist(), experts.tolist(), counts.tolist(), strict=True))
        decode = tuple(table["decode_count"].tolist()) if version == 2 else None
        return cls(fingerprint, num_layers, num_experts, ranked, built_for_slots, decode)
