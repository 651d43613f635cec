"""Slot pool: S pair-sized slots in one device tensor [S, numel], plus the residency map.

`fill(ranked_pairs)` copies the blobs of the first S distinct pairs from the host store (the
residency policy decides which are pinned) and verifies slot 0 by comparing checksums of its
device bytes and its host copy. Fills during serving go through ExpertCache (copy stream).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from services.engine.cache.host_store import HostStore, blob_checksum
from services.engine.cache.policy import Pair, Residency, StaticResidency


@dataclass(frozen=True)
class FillReport:
    filled: int
    total_slots: int
    elapsed_s: float
    mb_per_s: float  # 10**6 bytes per second
    verified: bool  # slot 0's checksum equals its host copy's (True when nothing was filled)
    source: str = "ranking"

    def log_line(self) -> str:
        check = (
            ("slot 0 verified" if self.verified else "slot 0 CHECKSUM MISMATCH")
            if self.filled
            else "nothing to verify"
        )
        return (
            f"pre-filled {self.filled} of {self.total_slots} slots from the {self.source} in "
            f"{self.elapsed_s:.1f} s ({self.mb_per_s:.0f} MB/s); {check}"
        )


class SlotPool:
    def __init__(
        self,
        num_slots: int,
        host: HostStore,
        device: torch.device,
        policy: Residency | None = None,
    ):
        self.host = host
        self.device = device
        self.policy = policy if policy is not None else StaticResidency(num_slots)
        assert self.policy.num_slots == num_slots
        self.slots = torch.empty(
            num_slots, host.format.numel, dtype=host.dtype, device=device
        )  # [S, numel]

    @property
    def num_slots(self) -> int:
        return self.slots.shape[0]

    def lookup(self, pair: Pair) -> torch.Tensor | None:
        """The resident blob of `pair` on the device, or None on a miss."""
        slot = self.policy.lookup(pair)
        return None if slot is None else self.slots[slot]

    def fill(self, ranked_pairs: Iterable[Pair], source: str = "ranking") -> FillReport:
        t0 = time.perf_counter()
        plan = self.policy.plan_fill(pair for pair in ranked_pairs if pair in self.host)
        for slot, pair in plan:
            self.slots[slot].copy_(self.host.blob(pair), non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed_s = time.perf_counter() - t0
        verified = True
        if plan:
            slot0 = next(pair for slot, pair in plan if slot == 0)
            verified = blob_checksum(self.slots[0]) == self.host.checksum(slot0)
        moved = len(plan) * self.host.slot_bytes
        return FillReport(
            filled=len(plan),
            total_slots=self.num_slots,
            elapsed_s=elapsed_s,
            mb_per_s=moved / 1e6 / max(elapsed_s, 1e-9),
            verified=verified,
            source=source,
        )
