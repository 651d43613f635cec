"""ExpertCache: the MoE block's view of the cache — batch-aware lookups, miss placement, prefetch.

Shape legend: T tokens in the step (any number of sequences), K routed per token, E experts,
D hidden, n tokens routed to one expert.

Per step and MoE layer the model calls, in this order:

    route(layer, top_idx [T, K], counts [E])  one lookup per *distinct* pair for all T tokens:
                                              hits -> their slot; admitted misses -> a slot fill
                                              starts; every miss gets a placement (host / copy)
    predict(layer + 1, predicted [T, K])      (decode steps, when wanted) next layer's router on
                                              this layer's hidden state: prefetch fills start
    apply(layer, x [T, D], top_idx, top_w)    the routed experts where route() placed them,
                                              weighted sum per token -> [T, D]

Residency decisions live in `Residency` (pure, shared with replay); this class moves bytes.
A step may hold tokens of many sequences (continuous batching): call `begin_step(T, prefill)`
once per step; every token makes K lookups per MoE layer, and after the forward pass
`step_token_hits[t]` holds token t's hits (`step_tokens` [3, T]: hits, misses on the host,
misses copied), so per-sequence figures are sums over its tokens.
On CUDA, fills run on their own copy stream: each fill first waits for the compute stream's
"reads done" event of the previous layer (its victim may still be read there) and records a
per-slot "ready" event the compute stream waits on before the slot's first use. Compute never
waits for copies it does not need. On CPU every copy is a synchronous memcpy.

Outputs never depend on residency or placement: a slot, the staging buffer and the host store
hold the same bytes, and the same kernel reads them (bit-identical). Only where "host" means the
CPU computing for a CUDA device (no Triton, quantized experts) can a host placement differ in
the last bits (see placement.py: the `exact` mode never uses it there).

apply() moves the bytes each routed expert needs (`_place`: its slot, a staging copy of a host
blob, or the host blob itself read in place; on CUDA the copies it must wait for) and hands
them to the layer's compute, chosen once from the format and the device
(cache/moe_compute.py): the C kernel or the Triton kernel reading every blob by address in one
call, or the format's torch ops per expert.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from services.common.counters import CacheCounters
from services.engine.cache.host_store import HostStore
from services.engine.cache.link_meter import LinkMeter
from services.engine.cache.moe_compute import (
    CpuMoe,
    ExpertTable,
    Placed,
    TritonMoe,
    moe_compute,
)
from services.engine.cache.placement import Placer
from services.engine.cache.policy import Residency
from services.engine.cache.slot_pool import SlotPool
from services.engine.cache.stats import PredictionTracker, count_phases
from services.engine.cache.trace import DECODE, PREDICT, PREFILL, TraceWriter

if TYPE_CHECKING:
    from services.engine.kernels import CpuKernels

log = logging.getLogger("strata.engine")

_SLOT, _STAGING, _HOST = 0, 1, 2
NUM_STAGING = 8  # CUDA ring of staging buffers for copied misses that take no slot


def layer_counts(top: np.ndarray, num_experts: int) -> np.ndarray:
    """top [n, T, K] -> [n, E]: the rows routed to each expert, per layer (one bincount)."""
    n = top.shape[0]
    offsets = (np.arange(n) * num_experts)[:, None, None]
    return np.bincount((top + offsets).ravel(),
                       minlength=n * num_experts).reshape(n, num_experts)


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
        cpu_kernels: CpuKernels | None = None,
    ):
        self.host = host
        self.pool = pool
        self.format = host.format
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.on_cuda = pool.device.type == "cuda"
        self.placer = placer or Placer("host", None, host_exact=True)
        self.prefetch = prefetch
        self.recorder = recorder
        self.decode = CacheCounters()  # lifetime figures per phase
        self.prefill = CacheCounters()
        self.routing_counts = np.zeros((num_layers, num_experts), dtype=np.int64)  # [L, E]
        self.decode_routing_counts = np.zeros_like(self.routing_counts)  # [L, E] decode tokens
        self.link = LinkMeter()  # every host -> device copy: fills, staged misses, plan swaps
        self._predictions = PredictionTracker()
        self.distinct_pairs_routed = 0  # lifetime, over (step, layer): how batching shares pairs
        self.layer_steps = 0
        self._num_pairs = len(host.pairs)
        self.begin_step(0, False)
        self._plan: dict[int, tuple[int, int | None]] = {}  # expert -> (where, slot)
        self._counts = np.zeros(0, dtype=np.int64)  # [E] rows per expert, of the last route()
        num_staging = NUM_STAGING if self.on_cuda else 1
        self._staging = [torch.empty(self.format.numel, dtype=host.dtype, device=pool.device)
                         for _ in range(num_staging)]
        self.compute = moe_compute(self.format, pool.device, num_experts, cpu_kernels)
        self._blob_bytes = self.format.blob_bytes  # slot i at slots.data_ptr() + i * this
        # CUDA graphs: every pair's blob address [L, E] on the device (its slot once filled,
        # else the pinned host store), kept current by every fill; and each slot's pair
        self.addr_table: torch.Tensor | None = None
        self._slot_pair: list[tuple[int, int] | None] = [None] * pool.num_slots
        self._where: dict[tuple[int, int], int] = {}  # pair -> the slot its entry points to
        if self.on_cuda:
            self._copy_stream = torch.cuda.Stream(pool.device)
            self._slot_ready: dict[int, torch.cuda.Event] = {}
            self._reads_done: torch.cuda.Event | None = None
        # The C kernel reads the same table in a decode step that runs every layer in one call
        self._table: ExpertTable | None = None
        if isinstance(self.compute, CpuMoe):
            self.enable_address_table(num_layers)
            assert self.addr_table is not None
            self._table = self.compute.table(self.addr_table.numpy())

    @property
    def cpu_kernels(self) -> bool:
        """Whether apply() runs the CPU kernels."""
        return self.compute.kind == "cpu-kernel"

    @property
    def device_kernel(self) -> bool:
        """Whether apply() runs the Triton kernel (CUDA)."""
        return self.compute.kind == "triton"

    @property
    def host_exact(self) -> bool:
        """Whether a miss placed on the host gives the bits of a hit (the same kernel reads it
        there: always on CPU; on CUDA with the device kernel)."""
        return self.format.exact_on(self.pool.device, self.device_kernel)

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

    def begin_step(self, num_tokens: int, prefill: bool | np.ndarray) -> None:
        """A new forward pass over num_tokens rows; `prefill` marks the rows (or all of them)
        that are prompt tokens — a continuous-batching step mixes them with decode tokens."""
        rows = np.full(num_tokens, prefill, dtype=bool) if isinstance(prefill, bool) else prefill
        assert rows.shape == (num_tokens,)
        self._prefill_rows = rows
        self._decode_rows = np.flatnonzero(~rows)
        self._any_decode = len(self._decode_rows) > 0
        self._any_prefill = len(self._decode_rows) < num_tokens
        self.step_tokens = np.zeros((3, num_tokens), dtype=np.int64)  # [3, T] one allocation:
        # the hits of each row, its misses run on the host, its misses copied (views)
        self.step_token_hits, self.step_token_host, self.step_token_copied = self.step_tokens
        self._predictions.clear()

    @property
    def wants_predictions(self) -> bool:
        """Prefetch on and something left to prefetch (not every pair resident), or routing
        recorded: then the forward predicts the next layer's experts."""
        if not self._any_decode:
            return False
        if self.recorder is not None:
            return True
        return self.prefetch and self.residency.num_resident < self._num_pairs

    def route(self, layer: int, top_idx: torch.Tensor | np.ndarray,
              counts: Sequence[int] | np.ndarray, by_table: bool = False) -> None:
        """Look up this step's distinct experts of `layer` once each (counts [E]: rows routed
        to each); place the misses. `by_table`: the step already ran, reading every expert by
        table (a CUDA graph, or a CPU one-call step: see finish_table_step), each miss in place
        from the host store; no apply() follows."""
        top = top_idx if isinstance(top_idx, np.ndarray) else top_idx.cpu().numpy()  # [T, K]
        counts = np.asarray(counts)  # [E]
        if self._all_resident() and not (self._any_decode and self._predictions.pending(layer)):
            self._count_hits(slice(layer, layer + 1), top[None], counts[None])
            slot_of = self.residency.lookup
            self._plan = {} if by_table else {
                e: (_SLOT, slot_of((layer, e))) for e in np.flatnonzero(counts).tolist()}
            return
        experts_arr = np.flatnonzero(counts)  # distinct experts, ascending
        if self._any_prefill:
            decode_arr = np.bincount(top[~self._prefill_rows].ravel(),
                                     minlength=self.num_experts)[experts_arr]
        else:
            decode_arr = counts[experts_arr]
        experts, ns = experts_arr.tolist(), counts[experts_arr].tolist()
        ds = decode_arr.tolist()
        self.distinct_pairs_routed += len(experts)
        self.layer_steps += 1
        outcomes = self.residency.access(
            layer, list(zip(experts, ns, strict=True)),
            prefill=[d == 0 for d in ds] if self._any_prefill else False)
        if self._any_decode and self._predictions.pending(layer):
            self._predictions.routed(self.decode, layer,
                                     [e for e, d in zip(experts, ds, strict=True) if d])
        self.routing_counts[layer] += counts  # (a whole row: counts are 0 off experts_arr)
        if self._any_prefill:
            self.decode_routing_counts[layer, experts_arr] += decode_arr
        else:
            self.decode_routing_counts[layer] += counts
        self._counts = counts
        hit_slots = [out.slot for out in outcomes if out.hit]
        if len(hit_slots) == len(outcomes) and self.recorder is None:
            # every routed expert a hit (the common case): count_phases' sums at once
            decode_n, all_n = sum(ds), sum(ns)
            self.decode.lookups += decode_n
            self.decode.hits += decode_n
            self.prefill.lookups += all_n - decode_n
            self.prefill.hits += all_n - decode_n
            self._plan = {} if by_table else {e: (_SLOT, slot) for e, slot in
                                             zip(experts, hit_slots, strict=True)}
            self.step_token_hits += top.shape[1]  # each token's K lookups too
            return
        phases = [(e, d, n - d) for e, d, n in zip(experts, ds, ns, strict=True)]
        count_phases(self.decode, self.prefill, phases, outcomes)
        if self.recorder is not None:
            self._record(layer, phases)
        self._plan = {}
        missed: set[int] = set()
        for (expert, d, p), out in zip(phases, outcomes, strict=True):
            if out.fill:
                self._fill(out.slot, (layer, expert))
            if out.hit:
                self._plan[expert] = (_SLOT, out.slot)
                continue
            where, reason = ("host", "host:table") if by_table else self.placer.choose(d + p)
            c = self.decode if d else self.prefill
            c.reasons[reason] = c.reasons.get(reason, 0) + 1
            if where == "host":
                self.decode.misses_host += d
                self.prefill.misses_host += p
                self._plan[expert] = (_HOST, None)
            else:
                self.decode.misses_copied += d
                self.prefill.misses_copied += p
                self._plan[expert] = (_SLOT, out.slot) if out.fill else (_STAGING, None)
            missed.add(expert)
        if not missed:  # every routed expert a hit: each token's K lookups too
            self.step_token_hits += top.shape[1]
            return
        hit, host, copied = (np.zeros(self.num_experts, dtype=np.int64) for _ in range(3))  # [E]
        for expert, (where, _) in self._plan.items():
            (hit if expert not in missed else host if where == _HOST else copied)[expert] = 1
        self.step_token_hits += hit[top].sum(axis=1)  # [T]
        self.step_token_host += host[top].sum(axis=1)
        self.step_token_copied += copied[top].sum(axis=1)

    def _all_resident(self) -> bool:
        """Every pair in a slot (and no routing trace to record): every lookup is a hit, and
        no eviction can come while it lasts, so the lookups are counted in bulk and leave the
        policy's order as it is (Residency.hit_every_pair): on the default model 6-11 us a
        layer instead of 42-109 (scripts/lookup_cost.py, 1 and 8 rows)."""
        return self.residency.num_resident == self._num_pairs and self.recorder is None

    def _count_hits(self, layers: slice | list[int], top: np.ndarray, counts: np.ndarray
                    ) -> None:
        """The lookups of `layers` (n MoE layers, a slice of the layers when they are
        consecutive: the routing counts' rows as a view, not an index; top [n, T, K] their
        top-K, counts [n, E] rows routed to each expert) when all of them hit: the figures
        route() keeps."""
        n, T, K = top.shape
        if self._any_prefill:
            decode = layer_counts(top[:, self._decode_rows], self.num_experts)
        else:
            decode = counts
        distinct = int(np.count_nonzero(counts))
        self.residency.hit_every_pair(distinct)
        self.distinct_pairs_routed += distinct
        self.layer_steps += n
        self.routing_counts[layers] += counts
        self.decode_routing_counts[layers] += decode
        decode_n, all_n = n * len(self._decode_rows) * K, n * T * K  # K experts a row
        self.decode.lookups += decode_n
        self.decode.hits += decode_n
        self.prefill.lookups += all_n - decode_n
        self.prefill.hits += all_n - decode_n
        self.step_token_hits += n * K  # each token's K lookups a layer
        self._counts = counts[-1]

    def _record(self, layer: int, phases: list[tuple[int, int, int]]) -> None:
        assert self.recorder is not None
        experts = [e for e, _, _ in phases]
        if all(p == 0 for _, _, p in phases):
            self.recorder.layer_record(DECODE, layer, experts, [d for _, d, _ in phases])
        elif all(d == 0 for _, d, _ in phases):
            self.recorder.layer_record(PREFILL, layer, experts, [p for _, _, p in phases])
        else:
            self.recorder.mixed_record(layer, experts, [d for _, d, _ in phases],
                                       [p for _, _, p in phases])

    def predict(self, layer: int, predicted: torch.Tensor) -> None:
        """Experts predicted for `layer` (next layer's router top-K [T, K]) by this step's decode
        tokens; prefetch them."""
        rows = torch.as_tensor(self._decode_rows, device=predicted.device)
        experts = torch.unique(predicted[rows].cpu()).tolist()
        self._predictions.predict(layer, experts)
        if self.recorder is not None:
            self.recorder.layer_record(PREDICT, layer, experts, [0] * len(experts))
        if self.prefetch:
            fills = self.residency.prefetch(layer, experts)
            for slot, pair in fills:
                self._fill(slot, pair)
            self.decode.prefetch_fills += len(fills)

    def apply(self, layer: int, x: torch.Tensor, top_idx: torch.Tensor,
              top_w: torch.Tensor) -> torch.Tensor:
        """This step's routed experts of `layer` on x [T, D] (top_idx [T, K] on the host,
        top_w [T, K]) where route() placed them -> [T, D]: per token the sum of its experts'
        outputs times their weights, in ascending expert id (cache/moe_compute.py)."""
        y = self.compute(x, top_idx, top_w, self._place(layer))
        self._layer_done()
        return y

    def _place(self, layer: int) -> Placed:
        """Each routed expert's bytes as route() placed them: its slot (waiting for the slot's
        fill if it is in flight), a staging copy of its host blob (one buffer per staged expert
        of the layer), or the host blob itself, read in place."""
        placed = Placed({}, {}, self._counts, layer)
        staged = 0
        for expert, (where, slot) in self._plan.items():
            if where == _SLOT:
                assert slot is not None
                placed.blobs[expert] = self.pool.slots[slot]
                ready = self._slot_ready.pop(slot, None) if self.on_cuda else None
            else:
                blob, ready = self.host.blob((layer, expert)), None
                if where == _STAGING:  # a copied miss without a slot
                    blob, ready = self._stage(staged, blob)
                    staged += 1
                placed.blobs[expert] = blob
            if ready is not None:
                placed.ready[expert] = ready
        return placed

    # -- decode steps captured in a CUDA graph ------------------------------------------------
    def enable_address_table(self, num_layers: int) -> None:
        """Keep a device table of every pair's blob address (what graphed steps read)."""
        if self.addr_table is None:
            self.addr_table = torch.zeros(num_layers, self.num_experts, dtype=torch.int64,
                                          device=self.pool.device)
            self.refresh_addresses()

    def refresh_addresses(self) -> None:
        """Rebuild the address table from the residency (after a full pre-fill)."""
        self._slot_pair = [None] * self.pool.num_slots
        self._where = {pair: self.residency.lookup(pair) for pair in  # type: ignore[misc]
                       self.residency.resident_pairs}
        for pair, slot in self._where.items():
            self._slot_pair[slot] = pair
        if self.addr_table is None:
            return
        table = np.zeros(tuple(self.addr_table.shape), dtype=np.int64)
        for layer, expert in self.host.pairs:
            table[layer, expert] = self.host.blob((layer, expert)).data_ptr()
        base = self.pool.slots.data_ptr()
        for slot, pair in enumerate(self._slot_pair):
            if pair is not None:
                table[pair] = base + slot * self._blob_bytes
        self.addr_table.copy_(torch.from_numpy(table))

    def step_table(self) -> ExpertTable | None:
        """Every pair's blob address, for a CPU decode step that runs all its layers in one C
        call and makes its lookups after it (finish_table_step), as a CUDA graph replay does:
        the same lookups, hits, policy state and fills as looking up layer by layer, each miss
        read in place from the host store (reason "host:table"; the bits of a hit: the same
        kernel reads the same bytes). None where the layers must run one by one: no CPU kernel,
        every miss to be copied (`--placement copy`), or predictions wanted (next-layer
        prefetch with pairs left to fetch, or a routing trace being recorded: each needs every
        layer's hidden state before the next layer runs)."""
        if self._table is None or self.placer.mode == "copy" or self.wants_predictions:
            return None
        return self._table

    def apply_graphed(self, layer: int, x: torch.Tensor, top_idx: torch.Tensor,
                      top_w: torch.Tensor) -> torch.Tensor:
        """apply() inside a CUDA graph: top_idx, top_w [T, K] on the device; each expert read
        at its address in the table — its slot, or in place from the host store."""
        assert isinstance(self.compute, TritonMoe) and self.addr_table is not None
        return self.compute.graphed(layer, x, top_idx, top_w, self.addr_table[layer])

    def finish_table_step(self, moe_layers: Sequence[int], top_idx: np.ndarray,
                          counts: np.ndarray) -> None:
        """The lookups of a step that read its experts by table (a CUDA graph's replay, or a
        CPU step_table's one-call step), after it: top_idx [Lm, T, K] and counts [Lm, E] (rows
        routed to each expert: layer_counts(top_idx), which the CPU step counts as it routes),
        one route() per MoE layer in layer order, as an eager step makes them, so hits, policy
        state and fills are an eager step's (less the next-layer prefetch, which cannot help a
        step that has already run). The step read every miss in place; the fills the policy
        admits serve the later steps."""
        if self._all_resident():  # (a table step never has next-layer predictions)
            every = len(moe_layers) == self.num_layers  # (ascending, none twice)
            self._count_hits(slice(None) if every else list(moe_layers), top_idx, counts)
            self._plan = {}
            return
        for layer, top, per_expert in zip(moe_layers, top_idx, counts, strict=True):
            self.route(layer, top, per_expert, by_table=True)

    def _stage(self, i: int, blob: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Copy a host blob into staging buffer i (each staged expert of a layer has its own:
        the kernels read a layer's experts at once) -> (buffer, its "ready" event on CUDA).
        On CUDA the copy runs on the copy stream after the last layer's reads of the buffer."""
        while len(self._staging) <= i:
            self._staging.append(torch.empty_like(self._staging[0]))
        buf = self._staging[i]
        if not self.on_cuda:
            t0 = time.perf_counter()
            buf.copy_(blob)
            self.link.add(self.host.slot_bytes, time.perf_counter() - t0)
            return buf, None
        with torch.cuda.stream(self._copy_stream):
            if self._reads_done is not None:
                self._copy_stream.wait_event(self._reads_done)
            start = torch.cuda.Event(enable_timing=True)
            start.record(self._copy_stream)
            buf.copy_(blob, non_blocking=True)
            ready = torch.cuda.Event(enable_timing=True)
            ready.record(self._copy_stream)
        self.link.add_timed(self.host.slot_bytes, start, ready)
        return buf, ready

    def _layer_done(self) -> None:
        """CUDA: mark this layer's slot reads as enqueued (fills of their slots wait on it)."""
        if self.on_cuda:
            self._reads_done = torch.cuda.Event()
            self._reads_done.record(torch.cuda.current_stream(self.pool.device))

    def quiesce(self) -> None:
        """Wait for every fill in flight (CUDA), e.g. before the pool is refilled from a plan."""
        if self.on_cuda:
            self._copy_stream.synchronize()
            torch.cuda.current_stream(self.pool.device).synchronize()
            self._slot_ready.clear()
            self._reads_done = None

    def take_routing_counts(self) -> np.ndarray:
        """Counts [L, E] since the last call; resets them (the decode counts too)."""
        return self.take_phase_routing_counts()[0]

    def take_phase_routing_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """(all routed tokens, decode tokens alone), each [L, E], since the last call; resets
        both. The decode counts are what the decode hit rate is measured on."""
        counts, self.routing_counts = self.routing_counts, np.zeros_like(self.routing_counts)
        decode = self.decode_routing_counts
        self.decode_routing_counts = np.zeros_like(decode)
        return counts, decode

    # -- a new plan, a few slots per step ------------------------------------------------------
    def begin_plan(self, ranked_pairs: Sequence[tuple[int, int]]) -> None:
        """Start applying a new ranking (a plan version) without stopping: `apply_plan_step`
        then swaps a bounded number of slots per call, between engine steps; the pairs the
        plan keeps are never moved. The whole ranking goes into the routing trace."""
        ranked = [(int(layer), int(e)) for layer, e in ranked_pairs]
        if self.recorder is not None:
            self.recorder.fill_record(ranked)
        self.residency.begin_plan(pair for pair in ranked if pair in self.host)

    def apply_plan_step(self, max_swaps: int) -> tuple[int, bool]:
        """Fill at most `max_swaps` slots towards the plan (copy stream on CUDA, ordered after
        the last step's reads like any fill); returns (slots filled, whether it is in place)."""
        fills, done = self.residency.plan_step(max_swaps)
        for slot, pair in fills:
            self._fill(slot, pair)
        return len(fills), done

    # -- moving bytes ------------------------------------------------------------------------
    def _fill(self, slot: int, pair: tuple[int, int]) -> None:
        dst, src = self.pool.slots[slot], self.host.blob(pair)
        # First, no later step may read the bytes this fill replaces, nor `pair` where it was
        old = self._slot_pair[slot]
        if old is not None:
            self._unmap(old)
        if pair in self._where:  # (a plan moving a pair into the pinned core)
            self._unmap(pair)
        unmapped = None
        if self.addr_table is not None and self.on_cuda:
            unmapped = torch.cuda.Event()
            unmapped.record(torch.cuda.current_stream(self.pool.device))
        self._slot_pair[slot], self._where[pair] = pair, slot
        if not self.on_cuda:
            t0 = time.perf_counter()
            dst.copy_(src)
            self.link.add(self.host.slot_bytes, time.perf_counter() - t0)
            if self.addr_table is not None:
                self.addr_table[pair].fill_(dst.data_ptr())
            return
        with torch.cuda.stream(self._copy_stream):
            if self._reads_done is not None:
                self._copy_stream.wait_event(self._reads_done)
            if unmapped is not None:  # steps enqueued until now have read what they read here
                self._copy_stream.wait_event(unmapped)
            start = torch.cuda.Event(enable_timing=True)
            start.record(self._copy_stream)
            dst.copy_(src, non_blocking=True)
            if self.addr_table is not None:  # the slot is whole: later steps read it here
                self.addr_table[pair].fill_(dst.data_ptr())
            ready = torch.cuda.Event(enable_timing=True)
            ready.record(self._copy_stream)
        self._slot_ready[slot] = ready
        self.link.add_timed(self.host.slot_bytes, start, ready)

    def _unmap(self, pair: tuple[int, int]) -> None:
        """`pair` leaves its slot: its address-table entry (if there is a table) points back at
        the host store, written on the compute stream — after the pair's own fill and that
        fill's table write, if they are still in flight."""
        slot = self._where.pop(pair)
        self._slot_pair[slot] = None
        if self.addr_table is None:
            return
        ready = self._slot_ready.get(slot) if self.on_cuda else None
        if ready is not None:
            torch.cuda.current_stream(self.pool.device).wait_event(ready)
        self.addr_table[pair].fill_(self.host.blob(pair).data_ptr())
