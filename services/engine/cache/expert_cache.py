"""ExpertCache: runs one routed expert from its slot (hit) or from the host store (miss), and counts.

Shape legend: T tokens routed to this expert, D hidden.

Miss modes on CUDA (on CPU both are the same math on the host blob):
  "host"  copy x [T, D] to the host, compute there, copy the result back (nothing large crosses
          the link; host matmul rounding may differ from the device's in the last bits)
  "copy"  copy the blob over the link into a device staging buffer and compute on the device
          (bit-identical to a hit)
Counting: one lookup per routed (token, layer, expert); `hits` of them were served from a slot;
misses are spill. Per-pair routing counts accumulate in an int64 [L, E] array.
"""

from __future__ import annotations

import numpy as np
import torch

from services.engine.cache.host_store import HostStore
from services.engine.cache.slot_pool import SlotPool

MISS_MODES = ("host", "copy")


class ExpertCache:
    def __init__(
        self,
        host: HostStore,
        pool: SlotPool,
        num_layers: int,
        num_experts: int,
        miss_mode: str = "host",
    ):
        assert miss_mode in MISS_MODES, miss_mode
        self.host = host
        self.pool = pool
        self.layout = host.layout
        self.miss_mode = miss_mode
        self.lookups = 0
        self.hits = 0
        self.routing_counts = np.zeros((num_layers, num_experts), dtype=np.int64)  # [L, E]
        self._on_cuda = pool.device.type == "cuda"
        self._staging = (
            torch.empty(self.layout.numel, dtype=host.dtype, device=pool.device)
            if self._on_cuda and miss_mode == "copy"
            else None
        )

    @property
    def spilled(self) -> int:
        return self.lookups - self.hits

    def expert_forward(self, layer: int, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `expert` of `layer` on x [T, D] -> [T, D] on x's device; counts T lookups."""
        num_tokens = x.shape[0]
        self.lookups += num_tokens
        self.routing_counts[layer, expert] += num_tokens
        blob = self.pool.lookup((layer, expert))
        if blob is not None:
            self.hits += num_tokens
            return self.layout.forward(x, blob)
        host_blob = self.host.blob((layer, expert))
        if not self._on_cuda:
            return self.layout.forward(x, host_blob)
        if self._staging is not None:
            self._staging.copy_(host_blob, non_blocking=True)
            return self.layout.forward(x, self._staging)
        return self.layout.forward(x.cpu(), host_blob).to(x.device, non_blocking=True)

    def take_routing_counts(self) -> np.ndarray:
        """Counts [L, E] since the last call; resets them."""
        counts, self.routing_counts = self.routing_counts, np.zeros_like(self.routing_counts)
        return counts
