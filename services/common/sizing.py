"""Expert-cache sizing: plain arithmetic shared by the engine and the cache manager.

    slots = floor((free - reserved - draft_head) / slot_bytes), capped at the number of pairs
    coverage = slots / total_pairs
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.settings import format_bytes


@dataclass(frozen=True)
class CacheSize:
    free_bytes: int
    reserved_bytes: int
    draft_head_bytes: int
    slot_bytes: int
    total_pairs: int
    slots: int

    @property
    def coverage(self) -> float:
        return self.slots / self.total_pairs if self.total_pairs else 0.0

    @property
    def cache_bytes(self) -> int:
        return self.slots * self.slot_bytes

    def log_line(self) -> str:
        draft = (f" (+{self.draft_head_bytes / 2**20:.0f} MiB for the draft head)"
                 if self.draft_head_bytes else "")
        return (f"expert cache auto: {format_bytes(self.free_bytes)} free, "
                f"{self.reserved_bytes / 2**20:.0f} MiB reserved{draft} -> {self.slots} slots "
                f"({format_bytes(self.cache_bytes)}, coverage {self.coverage:.1%} of "
                f"{self.total_pairs} pairs)")


def size_cache(free_bytes: int, reserved_bytes: int, slot_bytes: int, total_pairs: int,
               draft_head_bytes: int = 0) -> CacheSize:
    assert slot_bytes > 0 and total_pairs >= 0
    usable = free_bytes - reserved_bytes - draft_head_bytes
    slots = max(0, min(total_pairs, usable // slot_bytes))
    return CacheSize(free_bytes, reserved_bytes, draft_head_bytes, slot_bytes, total_pairs, slots)
