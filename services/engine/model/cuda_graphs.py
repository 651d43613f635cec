"""Decode steps as CUDA graph replays: one graph per batch size T of a list, captured at start.

Shape legend: T decode tokens (one per sequence), nb block-table columns (a whole context
window's worth), Lm MoE layers, K routed per token, D hidden, V vocab.

A decode step on the device is hundreds of small kernels; launched one by one from Python the
host, not the GPU, sets the pace (measured: 12 ms of host time per step for 1.7 ms of device
work on the bench model). Captured once, a step replays with one launch. What makes it
capturable (Decoder.decode_graph_body, the decoder loop over a graphed Step): every input in a static device buffer, attention
by block table over the paged KV cache with lengths read on the device (a table as wide as the
context window, so its shape never changes), routing on the device, and each routed expert
read at its address in the expert cache's device table (ExpertCache.addr_table: its slot, or
the pinned host store in place) — no host decision inside the step.

The cache's lookups, hit counting, policy and fills still happen, after the replay, from the
routing the graph recorded (ExpertCache.finish_table_step): the same calls in the same order
as an eager step, so hit rates, traces and residency are an eager step's. What differs: every
miss of a graphed step is read in place over the link (placement reason "host:table"), a fill
the policy admits serves the steps after it, and there is no next-layer prefetch — a prediction
made inside the step could only start its copy after the step, for a token it no longer helps
(measured on the H200: predictions in the graph and fills after it cost 30% of decode speed at
full coverage and more at 25%, docs/benchmarks.md). Outputs do not change: the kernels read the
same bytes wherever they are (bit-identical to an eager decode step of the same batch).

The runner captures every batch size of its list when it starts (each graph's warm-up and
capture write K/V at position 0 of block 0, which no sequence holds yet) and decides per step:
a pure decode step of a captured batch size replays; steps that are not pure decode (prefill
chunks, mixed batches, draft verification), other batch sizes, and models or caches the body
cannot capture (MLA attention, grouped routing, an int8 KV cache, no Triton) run eagerly. Every
size is captured as it is, not padded to a larger one, so a replay keeps the bits of an eager
step of the same batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.engine.cache.expert_cache import ExpertCache, layer_counts
from services.engine.model.decoder import Decoder
from services.engine.model.paged_kv import PagedKVCache
from services.engine.model.step import DecodeRows, Span

log = logging.getLogger("strata.engine")

MAX_BATCH = 64  # the largest batch size captured


def graph_blocker(model: Decoder, kv: PagedKVCache, cache: ExpertCache) -> str | None:
    """Why decode steps of this model and caches cannot be captured, or None."""
    if model.device.type != "cuda":
        return "not on a CUDA device"
    if not cache.device_kernel or not model.backend.paged_attention:
        return "the Triton kernels are not available"
    blocked = [layer.index for layer in model.layers if not layer.capturable]
    if blocked:
        return f"layers {blocked[0]}.. (latent attention or grouped routing) are not captured"
    if kv.quantized:
        return "the int8 KV cache's writes are not captured"
    return None


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    host_in: torch.Tensor  # pinned [3T + T*nb]: token ids, positions, lengths, block ids
    inputs: torch.Tensor  # the same on the device: one copy per step
    route_top: torch.Tensor  # [Lm, T, K]
    hidden: torch.Tensor  # [T, D]
    logits: torch.Tensor  # [T, V]

    def views(self, batch: int) -> tuple[torch.Tensor, ...]:
        """(token_ids, positions, lengths [T], block_ids [T, nb]) views of `inputs`."""
        x = self.inputs
        return x[:batch], x[batch : 2 * batch], x[2 * batch : 3 * batch], \
            x[3 * batch :].view(batch, -1)


class DecodeGraphs:
    def __init__(self, model: Decoder, kv: PagedKVCache, cache: ExpertCache):
        self.model, self.kv, self.cache = model, kv, cache
        self.moe_layers = model.moe_layers
        self.num_blocks = -(-model.config.context_window // kv.block_size)  # nb
        self.pool = torch.cuda.graph_pool_handle()  # one memory pool for every graph
        self.graphs: dict[int, _Graph] = {}
        self.replays = 0
        cache.enable_address_table(len(model.layers))

    def capture(self, batches: Sequence[int]) -> None:
        """Capture the decode step of each batch size (1 <= T <= MAX_BATCH), from inputs
        that write position 0 of block 0 (token 0, length 1)."""
        for batch in sorted(set(batches)):
            assert 1 <= batch <= MAX_BATCH, f"batch size {batch} outside 1..{MAX_BATCH}"
            g = self._buffers(batch)
            g.host_in[2 * batch : 3 * batch] = 1  # lengths; ids, positions, blocks stay 0
            g.inputs.copy_(g.host_in)
            self._capture(g)
            self.graphs[batch] = g

    def run(self, token_ids: torch.Tensor, positions: torch.Tensor, spans: Sequence[Span]
            ) -> torch.Tensor | None:
        """One decode step (each span one sequence's next token; logits for every row) as a
        graph replay -> fp32 logits [T, V]; None when no graph of T rows was captured (run it
        eagerly). The inputs go to the device in one copy from a pinned buffer."""
        batch = len(spans)
        g = self.graphs.get(batch)
        if g is None:
            return None
        host = g.host_in.numpy()
        host[:batch] = token_ids.cpu().numpy()
        host[batch : 2 * batch] = positions.cpu().numpy()
        ids = host[3 * batch :].reshape(batch, self.num_blocks)
        P = self.kv.block_size
        for t, span in enumerate(spans):
            host[2 * batch + t] = span.pos_end
            used = -(-span.pos_end // P)
            ids[t, :used] = span.block_table[:used]
        g.inputs.copy_(g.host_in, non_blocking=True)  # the step below waits for it anyway
        g.graph.replay()
        self.replays += 1
        top = g.route_top.cpu().numpy()  # waits for the step (and so for the input copy)
        self.model.last_hidden = g.hidden.clone()
        counts = layer_counts(top, self.cache.num_experts)
        self.cache.finish_table_step(self.moe_layers, top, counts)
        return g.logits.clone()

    def _buffers(self, batch: int) -> _Graph:
        c, device = self.model.config, self.model.device
        K, Lm = c.experts_per_token, len(self.moe_layers)
        size = 3 * batch + batch * self.num_blocks
        return _Graph(
            graph=torch.cuda.CUDAGraph(),
            host_in=torch.zeros(size, dtype=torch.int64).pin_memory(),
            inputs=torch.zeros(size, dtype=torch.int64, device=device),
            route_top=torch.zeros(Lm, batch, K, dtype=torch.int64, device=device),
            hidden=torch.empty(0), logits=torch.empty(0))

    def _body(self, g: _Graph) -> tuple[torch.Tensor, torch.Tensor]:
        batch = g.route_top.shape[1]
        token_ids, positions, lengths, block_ids = g.views(batch)
        decode = DecodeRows(rows=torch.arange(batch, device=token_ids.device), all_rows=True,
                            ids=block_ids, lengths=lengths)
        return self.model.decode_graph_body(token_ids, positions, decode, self.kv, self.cache,
                                            g.route_top)

    def _capture(self, g: _Graph) -> None:
        """Warm up on a side stream (Triton compiles, cuBLAS picks its kernels), then capture.
        The warm-up runs the real step: it writes the same K/V the replay writes again."""
        t0 = time.perf_counter()
        side = torch.cuda.Stream(self.model.device)
        side.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(side):
            self._body(g)
        torch.cuda.current_stream(self.model.device).wait_stream(side)
        with torch.cuda.graph(g.graph, pool=self.pool):
            g.hidden, g.logits = self._body(g)
        log.debug("captured the decode step for batch %d as a CUDA graph in %.0f ms",
                  g.route_top.shape[1], (time.perf_counter() - t0) * 1e3)
