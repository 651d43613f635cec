"""Host store: every (layer, expert) pair's blob in one contiguous host tensor [P, numel].

Pinned on CUDA so slot fills and miss copies run at full link speed. Pair p of the ranking
`pairs` lives at row p; `blob(pair)` is a view, never a copy. Each pair is read from the
checkpoint by its format (cache/formats.py): as it is (fp32, bf16), quantized to bytes (int8,
int4), or as the file stores it (a GGUF block type).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from services.engine.cache.policy import Pair
from services.engine.model.checkpoint import CheckpointReader

if TYPE_CHECKING:
    from services.engine.cache.formats import ExpertFormat

log = logging.getLogger("strata.engine")


class HostStore:
    def __init__(
        self,
        fmt: ExpertFormat,
        pairs: Sequence[Pair],
        pin_memory: bool = False,
    ):
        self.format = fmt
        self.dtype = fmt.dtype  # what a blob (host row, slot) is made of
        self.pairs = [(int(layer), int(e)) for layer, e in pairs]
        self._row_of = {pair: row for row, pair in enumerate(self.pairs)}
        assert len(self._row_of) == len(self.pairs), "duplicate pairs"
        self.blobs = torch.empty(
            len(self.pairs), fmt.numel, dtype=self.dtype, pin_memory=pin_memory
        )  # [P, numel]
        self.load_seconds = 0.0

    @property
    def slot_bytes(self) -> int:
        return self.format.blob_bytes

    @property
    def total_bytes(self) -> int:
        return self.blobs.numel() * self.dtype.itemsize

    def __contains__(self, pair: Pair) -> bool:
        return pair in self._row_of

    def blob(self, pair: Pair) -> torch.Tensor:
        return self.blobs[self._row_of[pair]]  # [numel] view

    def checksum(self, pair: Pair) -> str:
        return blob_checksum(self.blob(pair))

    def load(self, reader: CheckpointReader) -> None:
        """Fill every row from the checkpoint, logging progress along the way; `load_seconds`
        is how long it took."""
        t0 = time.perf_counter()
        fmt = self.format
        step = max(64, -(-len(self.pairs) // 10))  # about every 10%, at most ~10 lines
        for row, (layer, expert) in enumerate(self.pairs):
            fmt.load(reader, layer, expert, out=self.blobs[row])
            if (row + 1) % step == 0 or row + 1 == len(self.pairs):
                seconds = time.perf_counter() - t0
                log.info(
                    "loading experts into the host store: %d/%d pairs (%.0f MiB) in %.1f s "
                    "(%.0f MiB/s)",
                    row + 1,
                    len(self.pairs),
                    (row + 1) * self.slot_bytes / 2**20,
                    seconds,
                    (row + 1) * self.slot_bytes / 2**20 / max(seconds, 1e-9),
                )
        self.load_seconds = time.perf_counter() - t0


def blob_checksum(blob: torch.Tensor) -> str:
    """sha256 of a blob's raw bytes (copied to the host first when it is on a device)."""
    raw = blob.detach().contiguous().cpu().view(torch.uint8).numpy()
    return hashlib.sha256(raw.tobytes()).hexdigest()
