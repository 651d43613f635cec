"""Expert-cache sizing: one rule, plain arithmetic, shared by the engine, the cache manager and
`strata plan`.

    limit = min(--device-memory, free device memory at start)     what the engine may take
    cache = limit - weights - KV - draft reserve - --reserve       each subtracted once
    slots = floor(cache / slot_bytes), capped at the number of pairs (or --cache-slots, which
            must fit in `cache`)
    coverage = slots / total_pairs

On CPU there is no device memory to measure: --device-memory stands in for it. `weights` are
the non-expert weights on the device (attention, norms, routers, dense and shared MLPs,
embeddings, lm_head); `--reserve` is for what is not counted: activations, CUDA graphs, the
allocator's slack. The cache manager, which sees no weights, plans with the slot count the
engine sends; a client that sends none gets `cache = device memory - reserve`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from services.common.settings import format_bytes


class BudgetError(ValueError):
    """The device memory does not hold what the engine needs besides the cache."""


@dataclass(frozen=True)
class CacheSize:
    limit_bytes: int  # what the engine may take
    reserved_bytes: int
    draft_head_bytes: int
    slot_bytes: int
    total_pairs: int
    slots: int
    weight_bytes: int = 0
    kv_bytes: int = 0
    free_bytes: int | None = None  # free device memory measured at start (None: not measured)
    configured_bytes: int | None = None  # --device-memory (None: not given)
    how: str = "auto"  # where the slot count comes from: "auto" (what the remainder holds),
    # "--cache-slots" (the operator's), "engine" (an engine's own, in the cache manager)

    @property
    def coverage(self) -> float:
        return self.slots / self.total_pairs if self.total_pairs else 0.0

    @property
    def cache_bytes(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def available_bytes(self) -> int:
        """The remainder for the cache after every other term."""
        return (self.limit_bytes - self.weight_bytes - self.kv_bytes - self.draft_head_bytes
                - self.reserved_bytes)

    @property
    def room_slots(self) -> int:
        """Slots the remainder holds (at most every pair)."""
        return max(0, min(self.total_pairs, self.available_bytes // self.slot_bytes))

    def terms(self) -> str:
        """The rule with this engine's numbers: limit - each term = the remainder."""
        if self.free_bytes is not None and self.configured_bytes is not None:
            limit = (f"min({format_bytes(self.free_bytes)} free, --device-memory "
                     f"{format_bytes(self.configured_bytes)}) = {format_bytes(self.limit_bytes)}")
        elif self.free_bytes is not None:
            limit = f"{format_bytes(self.free_bytes)} free"
        else:
            limit = f"{format_bytes(self.limit_bytes)} budget"
        terms = [f"{format_bytes(self.weight_bytes)} weights" if self.weight_bytes else "",
                 f"{format_bytes(self.kv_bytes)} KV" if self.kv_bytes else "",
                 f"{format_bytes(self.draft_head_bytes)} draft head"
                 if self.draft_head_bytes else "",
                 f"{format_bytes(self.reserved_bytes)} reserved"]
        left = self.available_bytes
        return (f"{limit} - {' - '.join(t for t in terms if t)} = "
                f"{'-' if left < 0 else ''}{format_bytes(abs(left))}")

    def check(self) -> None:
        """Raise BudgetError when the other terms alone exceed the limit, or --cache-slots
        does not fit in the remainder."""
        if self.available_bytes < 0:
            raise BudgetError(
                f"the device memory does not hold the engine without any cache: {self.terms()}; "
                "raise --device-memory, or lower --kv-memory or --reserve")
        if self.slots > self.room_slots:
            raise BudgetError(
                f"--cache-slots {self.slots} needs {format_bytes(self.cache_bytes)}, but "
                f"{self.terms()} holds {self.room_slots} slots; lower --cache-slots, "
                "--kv-memory or --reserve, or raise --device-memory")

    def log_line(self) -> str:
        if self.how == "engine":  # the cache manager does not see the engine's other terms
            return (f"expert cache: the engine's {self.slots} slots of "
                    f"{format_bytes(self.slot_bytes)} ({format_bytes(self.cache_bytes)}, "
                    f"coverage {self.coverage:.1%} of {self.total_pairs} pairs; its device "
                    f"memory {format_bytes(self.limit_bytes)})")
        return (f"expert cache {self.how}: {self.terms()} -> {self.slots} slots of "
                f"{format_bytes(self.slot_bytes)} ({format_bytes(self.cache_bytes)}, coverage "
                f"{self.coverage:.1%} of {self.total_pairs} pairs)")


def device_limit(configured_bytes: int | None, free_bytes: int | None) -> int:
    """What the engine may take: the smaller of the configured budget and the free memory."""
    known = [b for b in (configured_bytes, free_bytes) if b is not None]
    if not known:
        raise BudgetError("no device memory budget: give --device-memory (on CPU it stands in "
                          "for free VRAM)")
    return min(known)


def size_cache(limit_bytes: int, reserved_bytes: int, slot_bytes: int, total_pairs: int,
               draft_head_bytes: int = 0, *, weight_bytes: int = 0, kv_bytes: int = 0,
               free_bytes: int | None = None, configured_bytes: int | None = None,
               slots: int | None = None, how: str = "--cache-slots") -> CacheSize:
    """The cache of `limit_bytes` less every other term: as many slots as the remainder holds,
    or `slots` (capped at total_pairs; `CacheSize.check` says whether they fit), which `how`
    names."""
    assert slot_bytes > 0 and total_pairs >= 0
    size = CacheSize(limit_bytes, reserved_bytes, draft_head_bytes, slot_bytes, total_pairs, 0,
                     weight_bytes, kv_bytes, free_bytes, configured_bytes,
                     "auto" if slots is None else how)
    return replace(size, slots=size.room_slots if slots is None else min(slots, total_pairs))


class HostMemoryError(BudgetError):
    """The host does not hold the host store and the weights loaded beside it."""


def proc_kib(path: str, key: str) -> int | None:
    """A `key:  N kB` line's bytes in a /proc file (/proc/meminfo, /proc/self/status,
    /proc/self/smaps_rollup); None where the file or the line is not there."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def host_memory_available() -> int | None:
    """What can be allocated without swapping, in bytes: /proc/meminfo's MemAvailable, less
    where a cgroup v2 limit (a container's memory limit) leaves less; None where the kernel
    does not say."""
    available = proc_kib("/proc/meminfo", "MemAvailable")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            current = int(f.read().strip())
        if limit != "max":
            room = max(0, int(limit) - current)
            available = room if available is None else min(available, room)
    except (OSError, ValueError):
        pass
    return available


def check_host_memory(host_store_bytes: int, weight_bytes: int, available: int | None,
                      expert_format: str) -> None:
    """Refuse a model before anything is allocated when its host store (every pair's blob)
    plus its non-expert weights exceed the host's available memory; the message states both,
    and what would fit."""
    need = host_store_bytes + weight_bytes
    if available is None or need <= available:
        return
    raise HostMemoryError(
        f"the model does not fit this host's memory: host store {format_bytes(host_store_bytes)}"
        f" (every expert pair, {expert_format}) + non-expert weights "
        f"{format_bytes(weight_bytes)} = {format_bytes(need)}, and "
        f"{format_bytes(available)} is available; serve a smaller quantization of it (a "
        f"Q4_K_M or Q2_K GGUF holds experts at 4.9 / 2.6 bits per weight), --expert-dtype "
        f"int4 or int8 for a bf16/fp32 checkpoint, or a host with more memory")
