"""The expert profile: (layer, expert) pairs ranked by routing frequency, as `expert-profile.bin`.

The engine pre-fills its cache with the hottest `slots` pairs; the cache manager ranks pairs from
it when no routing counts are known yet. Both read and write through this module.

File format, version 1, all little-endian:

    offset  size  field
         0     8  magic            b"STRATAPF"
         8     4  u32 version      1
        12    16  fingerprint      model fingerprint, ASCII (hex), NUL-padded; first 16 chars
        28     4  u32 num_layers
        32     4  u32 num_experts
        36     4  u32 num_pairs      <= num_layers * num_experts
        40     8  u64 built_for_slots  slots of the cache it was built for (0 = unknown)
        48        num_pairs records of 12 bytes, hottest first:
                  u16 layer, u16 expert, u64 count
                  (count descending; equal counts in (layer, expert) order)
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"STRATAPF"
VERSION = 1
FINGERPRINT_CHARS = 16
_HEADER = struct.Struct("<8sI16sIIIQ")
_RECORD = np.dtype([("layer", "<u2"), ("expert", "<u2"), ("count", "<u8")])
assert _HEADER.size == 48 and _RECORD.itemsize == 12


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

    @property
    def total_pairs(self) -> int:
        return self.num_layers * self.num_experts

    @classmethod
    def from_counts(cls, counts: np.ndarray, fingerprint: str,
                    built_for_slots: int = 0) -> Profile:
        """Rank every pair of a [L, E] count table (zero counts included, last)."""
        counts = np.asarray(counts)
        if counts.ndim != 2:
            raise ValueError(f"counts must be [num_layers, num_experts], got shape {counts.shape}")
        if counts.size and counts.min() < 0:
            raise ValueError("counts must be >= 0")
        num_layers, num_experts = counts.shape
        order = rank_pairs(counts)
        flat = counts.reshape(-1)
        ranked = tuple((int(i) // num_experts, int(i) % num_experts, int(flat[i])) for i in order)
        profile = cls(fingerprint_key(fingerprint), num_layers, num_experts, ranked,
                      built_for_slots)
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

    def write(self, path: str | Path) -> None:
        """Write atomically: a temporary file in the same directory, then rename."""
        self._check()
        path = Path(path)
        records = np.array(self.ranked, dtype=np.int64).reshape(-1, 3)
        table = np.empty(len(self.ranked), dtype=_RECORD)
        table["layer"], table["expert"], table["count"] = records.T
        header = _HEADER.pack(MAGIC, VERSION, self.fingerprint.encode("ascii"), self.num_layers,
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
        if version != VERSION:
            raise ProfileError(f"{source}: profile format version {version}; this build reads "
                               f"version {VERSION}")
        expected = _HEADER.size + num_pairs * _RECORD.itemsize
        if len(data) != expected:
            raise ProfileError(f"{source}: {len(data)} bytes, expected {expected} for "
                               f"{num_pairs} pairs (truncated or corrupt)")
        if num_pairs > num_layers * num_experts:
            raise ProfileError(f"{source}: {num_pairs} pairs for a {num_layers}x{num_experts} "
                               "model")
        table = np.frombuffer(data, dtype=_RECORD, offset=_HEADER.size, count=num_pairs)
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
        return cls(fingerprint, num_layers, num_experts, ranked, built_for_slots)
