"""ExpertCache: the MoE block's view of the cache — batch-aware lookups, miss placement, prefetch.

Shape legend: T tokens in the step (any number of sequences), K routed per token, E experts,
D hidden, n tokens routed to one expert.

Per step and MoE layer the model calls, in this order:

    route(layer, top_idx [T, K], counts [E])  one lookup per *distinct* pair for all T tokens:
                                              hits -> their slot; admitted misses -> a slot fill
                                              starts; every miss gets a placement (host / copy)
    predict(layer + 1, predicted [T, K])      (decode steps, when wanted) next layer's router on
                                              this layer's hidden state: prefetch fills start
    expert_forward(layer, e, x [n, D])        per routed expert, ascending e: runs it where
                                              route() placed it
    layer_done(layer)                         CUDA: marks this layer's slot reads as enqueued

Residency decisions live in `Residency` (pure, shared with replay); this class moves bytes.
A step may hold tokens of many sequences (continuous batching): call `begin_step(T, prefill)`
once per step; every token makes K lookups per MoE layer, and after the forward pass
`step_token_hits[t]` holds token t's hits, so per-sequence figures are sums over its tokens.
On CUDA, fills run on their own copy stream: each fill first waits for the compute stream's
"reads done" event of the previous layer (its victim may still be read there) and records a
per-slot "ready" event the compute stream waits on before the slot's first use. Compute never
waits for copies it does not need. On CPU every copy is a synchronous memcpy.

Outputs never depend on residency or placement: a slot, the staging buffer and the host store
hold the same bytes, and on CPU the same math runs on them (bit-identical). On CUDA only the
"host" placement computes elsewhere (see placement.py: the `exact` mode never uses it there).
"""

from __future__ import annotations

import numpy as np
import torch

from services.engine.cache.host_store import HostStore
from services.engine.cache.placement import Placer
from services.engine.cache.policy import Residency
from services.engine.cache.slot_pool import SlotPool
from services.engine.cache.stats import CacheCounters, PredictionTracker, count_access
from services.engine.cache.trace import DECODE, PREDICT, PREFILL, TraceWriter

_SLOT, _STAGING, _HOST = 0, 1, 2
NUM_STAGING = 8  # CUDA ring of staging buffers for copied misses that take no slot


class ExpertCache:
    def __init__(
        self,
        host: HostStore,
        pool: SlotPool,
        num_layers: int,
        num_experts: int,
        placer: Placer | None = None,
        prefetch: bool = False,
        recorder: TraceWriter | None = None,
    ):
        self.host = host
        self.pool = pool
        self.layout = host.layout
        self.num_experts = num_experts
        self.on_cuda = pool.device.type == "cuda"
        self.placer = placer or Placer("host", None, self.on_cuda)
        self.prefetch = prefetch
        self.recorder = recorder
        self.decode = CacheCounters()  # lifetime figures per phase
        self.prefill = CacheCounters()
        self.routing_counts = np.zeros((num_layers, num_experts), dtype=np.int64)  # [L, E]
        self.step_token_hits = np.zeros(0, dtype=np.int64)  # [T] of the current step
        self._phase_prefill = False
        self._predictions = PredictionTracker()
        self._plan: dict[int, tuple[int, int | None]] = {}  # expert -> (where, slot)
        num_staging = NUM_STAGING if self.on_cuda else 1
        self._staging = [torch.empty(self.layout.numel, dtype=host.dtype, device=pool.device)
                         for _ in range(num_staging)]
        self._staging_next = 0
        if self.on_cuda:
            self._copy_stream = torch.cuda.Stream(pool.device)
            self._slot_ready: dict[int, torch.cuda.Event] = {}
            self._staging_free: list[torch.cuda.Event | None] = [None] * num_staging
            self._reads_done: torch.cuda.Event | None = None

    @property
    def residency(self) -> Residency:
        return self.pool.policy

    # Totals in the old single-phase shape (decode + prefill), for the cachemgr reports.
    @property
    def lookups(self) -> int:
        return self.decode.lookups + self.prefill.lookups

    @property
    def hits(self) -> int:
        return self.decode.hits + self.prefill.hits

    @property
    def spilled(self) -> int:
        return self.lookups - self.hits

    def begin_step(self, num_tokens: int, prefill: bool) -> None:
        self._phase_prefill = prefill
        self.step_token_hits = np.zeros(num_tokens, dtype=np.int64)
        self._predictions.clear()

    @property
    def wants_predictions(self) -> bool:
        return not self._phase_prefill and (self.prefetch or self.recorder is not None)

    def route(self, layer: int, top_idx: torch.Tensor, counts: list[int]) -> None:
        """Look up this step's distinct experts of `layer` once each; place the misses."""
        entries = [(e, n) for e, n in enumerate(counts) if n]  # distinct (expert, tokens)
        experts = [e for e, _ in entries]
        c = self.prefill if self._phase_prefill else self.decode
        outcomes = self.residency.access(layer, entries, prefill=self._phase_prefill)
        count_access(c, entries, outcomes)
        self._predictions.routed(c, layer, experts)
        self.routing_counts[layer, experts] += [n for _, n in entries]
        if self.recorder is not None:
            self.recorder.layer_record(PREFILL if self._phase_prefill else DECODE, layer,
                                       experts, [n for _, n in entries])
        self._plan = {}
        hit = np.zeros(self.num_experts, dtype=np.int64)  # [E]
        for (expert, n), out in zip(entries, outcomes, strict=True):
            if out.fill:
                self._fill(out.slot, (layer, expert))
            if out.hit:
                hit[expert] = 1
                self._plan[expert] = (_SLOT, out.slot)
                continue
            where, reason = self.placer.choose(n)
            c.reasons[reason] = c.reasons.get(reason, 0) + 1
            if where == "host":
                c.misses_host += n
                self._plan[expert] = (_HOST, None)
            else:
                c.misses_copied += n
                self._plan[expert] = (_SLOT, out.slot) if out.fill else (_STAGING, None)
        self.step_token_hits += hit[top_idx.cpu().numpy()].sum(axis=1)  # [T]

    def predict(self, layer: int, predicted: torch.Tensor) -> None:
        """Experts predicted for `layer` (next layer's router top-K [T, K]); prefetch them."""
        experts = torch.unique(predicted.cpu()).tolist()
        self._predictions.predict(layer, experts)
        if self.recorder is not None:
            self.recorder.layer_record(PREDICT, layer, experts, [0] * len(experts))
        if self.prefetch:
            fills = self.residency.prefetch(layer, experts)
            for slot, pair in fills:
                self._fill(slot, pair)
            self.decode.prefetch_fills += len(fills)

    def expert_forward(self, layer: int, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `expert` of `layer` on x [n, D] -> [n, D] on x's device, where route() put it."""
        where, slot = self._plan[expert]
        if where == _SLOT:
            return self.layout.forward(x, self._slot_blob(slot))  # type: ignore[arg-type]
        host_blob = self.host.blob((layer, expert))
        if where == _STAGING:
            return self._forward_staged(x, host_blob)
        if not self.on_cuda:
            return self.layout.forward(x, host_blob)
        return self.layout.forward(x.cpu(), host_blob).to(x.device, non_blocking=True)

    def layer_done(self, layer: int) -> None:
        if self.on_cuda:
            self._reads_done = torch.cuda.Event()
            self._reads_done.record(torch.cuda.current_stream(self.pool.device))

    def quiesce(self) -> None:
        """Wait for every fill in flight (CUDA), e.g. before the pool is refilled from a plan."""
        if self.on_cuda:
            self._copy_stream.synchronize()
            torch.cuda.current_stream(self.pool.device).synchronize()
            self._slot_ready.clear()
            self._staging_free = [None] * len(self._staging)
            self._reads_done = None

    def take_routing_counts(self) -> np.ndarray:
        """Counts [L, E] since the last call; resets them."""
        counts, self.routing_counts = self.routing_counts, np.zeros_like(self.routing_counts)
        return counts

    # -- moving bytes ------------------------------------------------------------------------
    def _fill(self, slot: int, pair: tuple[int, int]) -> None:
        dst, src = self.pool.slots[slot], self.host.blob(pair)
        if not self.on_cuda:
            dst.copy_(src)
            return
        with torch.cuda.stream(self._copy_stream):
            if self._reads_done is not None:
                self._copy_stream.wait_event(self._reads_done)
            dst.copy_(src, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._copy_stream)
        self._slot_ready[slot] = ready

    def _slot_blob(self, slot: int) -> torch.Tensor:
        if self.on_cuda:
            ready = self._slot_ready.pop(slot, None)
            if ready is not None:
                torch.cuda.current_stream(self.pool.device).wait_event(ready)
        return self.pool.slots[slot]

    def _forward_staged(self, x: torch.Tensor, host_blob: torch.Tensor) -> torch.Tensor:
        i = self._staging_next
        self._staging_next = (i + 1) % len(self._staging)
        buf = self._staging[i]
        if not self.on_cuda:
            buf.copy_(host_blob)
            return self.layout.forward(x, buf)
        compute = torch.cuda.current_stream(self.pool.device)
        with torch.cuda.stream(self._copy_stream):
            free = self._staging_free[i]
            if free is not None:
                self._copy_stream.wait_event(free)
            buf.copy_(host_blob, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._copy_stream)
        compute.wait_event(ready)
        y = self.layout.forward(x, buf)
        used = torch.cuda.Event()
        used.record(compute)
        self._staging_free[i] = used
        return y
