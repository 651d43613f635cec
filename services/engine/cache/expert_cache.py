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
`step_token_hits[t]` holds token t's hits, so per-sequence figures are sums over its tokens.
On CUDA, fills run on their own copy stream: each fill first waits for the compute stream's
"reads done" event of the previous layer (its victim may still be read there) and records a
per-slot "ready" event the compute stream waits on before the slot's first use. Compute never
waits for copies it does not need. On CPU every copy is a synchronous memcpy.

Outputs never depend on residency or placement: a slot, the staging buffer and the host store
hold the same bytes, and the same kernel reads them (bit-identical). Only where "host" means the
CPU computing for a CUDA device (no Triton, quantized experts) can a host placement differ in
the last bits (see placement.py: the `exact` mode never uses it there).

How apply() computes: for a format the kernels take (cache/formats.py: `kernel_weight_dtype`,
fp32 and bf16 today), one kernel call per layer reads each routed expert's blob where it lies,
by address — no gather, no per-expert dispatch:
  CPU                   services.engine.kernels (C): slots, staging copies, the host store
  CUDA                  services.engine.kernels.gpu_moe (Triton): slots, staging copies, and the
                        pinned host store read in place over the link (zero-copy); the
                        groups of ready experts launch first, the ones whose copy is still in
                        flight after the compute stream has waited for it
Otherwise (quantized experts, no C compiler, no Triton) the tokens are grouped by expert with
one gather, each expert runs on its rows as the format's torch ops (`expert_forward`), and one
scatter-add sums them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from services.engine.cache.formats import device_kernel
from services.engine.cache.host_store import HostStore
from services.engine.cache.layout import num_splits
from services.engine.cache.link_meter import LinkMeter
from services.engine.cache.placement import Placer
from services.engine.cache.policy import Residency
from services.engine.cache.slot_pool import SlotPool
from services.engine.cache.stats import CacheCounters, PredictionTracker, count_phases
from services.engine.cache.trace import DECODE, PREDICT, PREFILL, TraceWriter

if TYPE_CHECKING:
    from services.engine.kernels import CpuKernels

log = logging.getLogger("strata.engine")

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
        cpu_kernels: CpuKernels | None = None,
    ):
        self.host = host
        self.pool = pool
        self.format = host.format
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
        self.begin_step(0, False)
        self._plan: dict[int, tuple[int, int | None]] = {}  # expert -> (where, slot)
        self._counts = np.zeros(0, dtype=np.int64)  # [E] rows per expert, of the last route()
        num_staging = NUM_STAGING if self.on_cuda else 1
        self._staging = [torch.empty(self.format.numel, dtype=host.dtype, device=pool.device)
                         for _ in range(num_staging)]
        self._staging_next = 0
        takes = self.format.kernel_weight_dtype is not None
        self._cpu = cpu_kernels if takes and not self.on_cuda else None
        self._gpu = device_kernel(self.format, pool.device)
        # blob addresses for the kernels: slot i at slots_base + i * blob_bytes
        self._blob_addr = np.zeros(num_experts, dtype=np.int64)  # [E] this layer's
        self._blob_bytes = self.format.blob_bytes
        # CUDA graphs: every pair's blob address [L, E] on the device (its slot once filled,
        # else the pinned host store), kept current by every fill; and each slot's pair
        self.addr_table: torch.Tensor | None = None
        self._slot_pair: list[tuple[int, int] | None] = [None] * pool.num_slots
        self._where: dict[tuple[int, int], int] = {}  # pair -> the slot its entry points to
        if self.on_cuda:
            self._copy_stream = torch.cuda.Stream(pool.device)
            self._slot_ready: dict[int, torch.cuda.Event] = {}
            self._staging_free: list[torch.cuda.Event | None] = [None] * num_staging
            self._reads_done: torch.cuda.Event | None = None

    @property
    def cpu_kernels(self) -> bool:
        """Whether apply() runs the CPU kernels."""
        return self._cpu is not None

    @property
    def device_kernel(self) -> bool:
        """Whether apply() runs the Triton kernel (CUDA)."""
        return self._gpu is not None

    @property
    def host_exact(self) -> bool:
        """Whether a miss placed on the host gives the bits of a hit (the same kernel reads it
        there: always on CPU; on CUDA with the device kernel)."""
        return self.format.exact_on(self.pool.device, self._gpu is not None)

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
        self._any_prefill = bool(rows.any())
        self._any_decode = len(self._decode_rows) > 0
        self.step_token_hits = np.zeros(num_tokens, dtype=np.int64)
        self.step_token_host = np.zeros(num_tokens, dtype=np.int64)  # [T] misses on the host
        self.step_token_copied = np.zeros(num_tokens, dtype=np.int64)  # [T] misses copied
        self._predictions.clear()

    @property
    def wants_predictions(self) -> bool:
        return len(self._decode_rows) > 0 and (self.prefetch or self.recorder is not None)

    def route(self, layer: int, top_idx: torch.Tensor | np.ndarray,
              counts: Sequence[int] | np.ndarray, graphed: bool = False) -> None:
        """Look up this step's distinct experts of `layer` once each (counts [E]: rows routed
        to each); place the misses. `graphed`: the step already ran in a CUDA graph, which read
        every miss in place from the host store (see finish_graphed_step)."""
        top = top_idx if isinstance(top_idx, np.ndarray) else top_idx.cpu().numpy()  # [T, K]
        counts = np.asarray(counts)  # [E]
        experts_arr = np.flatnonzero(counts)  # distinct experts, ascending
        if self._any_prefill:
            decode_arr = np.bincount(top[~self._prefill_rows].ravel(),
                                     minlength=self.num_experts)[experts_arr]
        else:
            decode_arr = counts[experts_arr]
        experts, ns = experts_arr.tolist(), counts[experts_arr].tolist()
        ds = decode_arr.tolist()
        phases = [(e, d, n - d) for e, d, n in zip(experts, ds, ns, strict=True)]
        self.distinct_pairs_routed += len(experts)
        self.layer_steps += 1
        outcomes = self.residency.access(
            layer, list(zip(experts, ns, strict=True)),
            prefill=[d == 0 for d in ds] if self._any_prefill else False)
        count_phases(self.decode, self.prefill, phases, outcomes)
        if self._any_decode:
            self._predictions.routed(self.decode, layer,
                                     [e for e, d in zip(experts, ds, strict=True) if d])
        self.routing_counts[layer, experts_arr] += counts[experts_arr]
        self.decode_routing_counts[layer, experts_arr] += decode_arr
        if self.recorder is not None:
            self._record(layer, phases)
        self._plan = {}
        self._counts = counts
        missed: set[int] = set()
        for (expert, d, p), out in zip(phases, outcomes, strict=True):
            if out.fill:
                self._fill(out.slot, (layer, expert))
            if out.hit:
                self._plan[expert] = (_SLOT, out.slot)
                continue
            where, reason = ("host", "host:graph") if graphed else self.placer.choose(d + p)
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
        outputs times their weights, in ascending expert id."""
        if self._cpu is not None:
            return self._apply_kernel(layer, x, top_idx, top_w)
        if self._gpu is not None:
            return self._apply_gpu(layer, x, top_idx, top_w)
        K = top_idx.shape[1]
        order = torch.argsort(top_idx.flatten(), stable=True).to(x.device)  # [T*K], grouped by expert
        token_of = order // K  # [T*K]
        weight_of = top_w.flatten()[order]  # [T*K]
        xs = x[token_of]  # [T*K, D], rows grouped by expert: one gather in
        ys = torch.empty_like(xs)  # [T*K, D]
        start = 0
        for expert, n in enumerate(self._counts):
            if n:
                ys[start : start + n] = self.expert_forward(layer, expert, xs[start : start + n])
                start += n
        self._layer_done()
        # One scatter-add out: index_add_ walks the rows in order, so each token still sums
        # its experts by ascending id.
        return torch.zeros_like(x).index_add_(0, token_of, ys * weight_of[:, None])  # [T, D]

    def _apply_kernel(self, layer: int, x: torch.Tensor, top_idx: torch.Tensor,
                      top_w: torch.Tensor) -> torch.Tensor:
        assert self._cpu is not None
        addr = self._blob_addr
        slots_base = self.pool.slots.data_ptr()
        staged = 0
        for expert, (where, slot) in self._plan.items():
            if where == _SLOT:
                addr[expert] = slots_base + slot * self._blob_bytes
                continue
            blob = self.host.blob((layer, expert))
            if where == _STAGING:  # a copied miss without a slot: through a staging buffer
                blob = self._stage_cpu(staged, blob)
                staged += 1
            addr[expert] = blob.data_ptr()
        return self._cpu.moe(x.contiguous(), top_idx, top_w.contiguous(), addr,
                             self.format.ffn_size, num_splits(self.format.hidden_size),
                             weight_dtype=self.host.dtype)

    def _apply_gpu(self, layer: int, x: torch.Tensor, top_idx: torch.Tensor,
                   top_w: torch.Tensor) -> torch.Tensor:
        """apply() on CUDA with the Triton kernel: hits, and misses read in place from the pinned
        host store, launch at once; slots still being filled and staged copies after the compute
        stream has waited for their copies."""
        gpu = self._gpu
        assert gpu is not None
        addr = self._blob_addr
        slots_base = self.pool.slots.data_ptr()
        pending = np.zeros(self.num_experts, dtype=bool)  # [E] waits for a copy
        waits: list[torch.cuda.Event] = []
        staged = 0
        for expert, (where, slot) in self._plan.items():
            ready = None
            if where == _SLOT:
                addr[expert] = slots_base + slot * self._blob_bytes
                ready = self._slot_ready.pop(slot, None)
            elif where == _HOST:  # the device reads the pinned host blob over the link
                addr[expert] = self.host.blob((layer, expert)).data_ptr()
            else:
                buf, ready = self._stage_device(staged, self.host.blob((layer, expert)))
                addr[expert] = buf.data_ptr()
                staged += 1
            if ready is not None:
                pending[expert] = True
                waits.append(ready)
        groups = gpu.group_rows(top_idx.numpy(), ~pending if waits else None)
        compute = torch.cuda.current_stream(self.pool.device)

        def wait_for_copies() -> None:
            for ready in waits:
                compute.wait_event(ready)

        y = gpu.moe(x, top_w, groups, addr, self.format.ffn_size,
                    num_splits(self.format.hidden_size),
                    split=int((~pending[groups.expert]).sum()) if waits else None,
                    between=wait_for_copies if waits else None)
        self._layer_done()
        return y

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

    def apply_graphed(self, layer: int, x: torch.Tensor, top_idx: torch.Tensor,
                      top_w: torch.Tensor) -> torch.Tensor:
        """apply() inside a CUDA graph: top_idx, top_w [T, K] on the device; each expert read
        at its address in the table — its slot, or in place from the host store."""
        assert self._gpu is not None and self.addr_table is not None
        return self._gpu.moe_device(x, top_idx, top_w, self.addr_table[layer],
                                    self.format.ffn_size, num_splits(self.format.hidden_size))

    def finish_graphed_step(self, moe_layers: Sequence[int], top_idx: np.ndarray) -> None:
        """The lookups of a step that ran in a CUDA graph, after it: top_idx [Lm, T, K], one
        route() per MoE layer in layer order, as an eager step makes them, so hits, policy
        state and fills are an eager step's (less the next-layer prefetch, which cannot help
        a step that has already run). The step read every miss in place; the fills the policy
        admits serve the later steps."""
        for j, layer in enumerate(moe_layers):
            top = top_idx[j]
            self.route(layer, top, np.bincount(top.ravel(), minlength=self.num_experts),
                       graphed=True)

    def _stage_device(self, i: int, blob: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Copy a host blob into device staging buffer i on the copy stream (after the last
        layer's reads of the buffer); -> (buffer, its "ready" event)."""
        while len(self._staging) <= i:
            self._staging.append(torch.empty_like(self._staging[0]))
        with torch.cuda.stream(self._copy_stream):
            if self._reads_done is not None:
                self._copy_stream.wait_event(self._reads_done)
            start = torch.cuda.Event(enable_timing=True)
            start.record(self._copy_stream)
            self._staging[i].copy_(blob, non_blocking=True)
            ready = torch.cuda.Event(enable_timing=True)
            ready.record(self._copy_stream)
        self.link.add_timed(self.host.slot_bytes, start, ready)
        return self._staging[i], ready

    def _stage_cpu(self, i: int, blob: torch.Tensor) -> torch.Tensor:
        """Copy a blob into CPU staging buffer i (the kernel reads a layer's experts at once,
        so each staged one of the layer needs its own)."""
        while len(self._staging) <= i:
            self._staging.append(torch.empty_like(self._staging[0]))
        t0 = time.perf_counter()
        self._staging[i].copy_(blob)
        self.link.add(self.host.slot_bytes, time.perf_counter() - t0)
        return self._staging[i]

    def expert_forward(self, layer: int, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `expert` of `layer` on x [n, D] -> [n, D] on x's device, where route() put it."""
        where, slot = self._plan[expert]
        if where == _SLOT:
            return self.format.forward(x, self._slot_blob(slot))  # type: ignore[arg-type]
        host_blob = self.host.blob((layer, expert))
        if where == _STAGING:
            return self._forward_staged(x, host_blob)
        if not self.on_cuda:
            return self.format.forward(x, host_blob)
        return self.format.forward(x.cpu(), host_blob).to(x.device, non_blocking=True)

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
            self._staging_free = [None] * len(self._staging)
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
            t0 = time.perf_counter()
            buf.copy_(host_blob)
            self.link.add(self.host.slot_bytes, time.perf_counter() - t0)
            return self.format.forward(x, buf)
        compute = torch.cuda.current_stream(self.pool.device)
        with torch.cuda.stream(self._copy_stream):
            free = self._staging_free[i]
            if free is not None:
                self._copy_stream.wait_event(free)
            start = torch.cuda.Event(enable_timing=True)
            start.record(self._copy_stream)
            buf.copy_(host_blob, non_blocking=True)
            ready = torch.cuda.Event(enable_timing=True)
            ready.record(self._copy_stream)
        self.link.add_timed(self.host.slot_bytes, start, ready)
        compute.wait_event(ready)
        y = self.format.forward(x, buf)
        used = torch.cuda.Event()
        used.record(compute)
        self._staging_free[i] = used
        return y
