"""ModelRunner: the engine's tensor side — checkpoint, expert cache, per-sequence KV and steps.

    checkpoint ─┬─> non-expert weights (device) ── Decoder.forward (backend) ──> logits [V]
                └─> HostStore (every pair) ──fill──> SlotPool (S slots, device)
                          ExpertCache.route: Residency (pinned core + dynamic region) per step,
                          misses placed on the host or copied (cost model), next-layer prefetch

The cache is sized by the one budget rule (services/common/sizing.py): min(--device-memory,
free device memory before loading) less the non-expert weights, the KV pool, the draft reserve
and --reserve, or --cache-slots if they fit. At start a link probe and timed expert runs feed
the miss-placement cost model, and decode steps are captured as CUDA graphs.
Logits of ids the tokenizer does not know (vocab padding) are masked to -inf.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections import abc
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from services.common.counters import CacheCounters
from services.common.sizing import (
    CacheSize,
    check_host_memory,
    device_limit,
    host_memory_available,
    size_cache,
)
from services.engine import hugepages
from services.engine.cache.expert_cache import ExpertCache
from services.engine.cache.formats import device_kernel, expert_format, inputs_major
from services.engine.cache.host_store import HostStore
from services.engine.cache.placement import (
    DEFAULT_PLACEMENT,
    Placer,
    measure_cost_model,
    probe_link,
)
from services.engine.cache.policy import DEFAULT_PREFETCH, PolicySpec, Residency
from services.engine.cache.slot_pool import FillReport, SlotPool
from services.engine.cache.trace import TraceWriter
from services.engine.kernels.backend import select_backend
from services.engine.model.blocks import BLOCK_TYPES
from services.engine.model.checkpoint import (
    NOT_LOADED,
    CheckpointReader,
    checkpoint_bytes,
    load_model_config,
    open_checkpoint,
)
from services.engine.model.config import ModelConfig
from services.engine.model.cuda_graphs import DecodeGraphs, graph_blocker
from services.engine.model.dtypes import dtype_name, resolve_dtype
from services.engine.model.families import weight_names
from services.engine.model.layers.mlp import ExpertMlp
from services.engine.model.loader import load_model
from services.engine.model.paged_kv import PagedKVCache
from services.engine.model.step import ExpertSource, Span
from services.engine.model.tokenizer import Tokenizer

log = logging.getLogger("strata.engine")

DEFAULT_KV_WINDOWS = 4  # default KV pool: this many full context windows
DEFAULT_GRAPH_BATCHES = range(1, 9)  # decode batch sizes captured as CUDA graphs at start


def slot_bytes_of(model_dir: Path, dtype: str | torch.dtype = "auto",
                  expert_dtype: str = "auto") -> int:
    """Bytes of one cache slot (one pair's blob) for a checkpoint served with these settings,
    without loading it: what the runner's start-up log line states."""
    config = load_model_config(Path(model_dir))
    reader = open_checkpoint(Path(model_dir), weight_names(config))
    return expert_format(config.hidden_size, config.moe_intermediate_size,
                         resolve_dtype(dtype, reader), expert_dtype,
                         reader.expert_storage(), reader.fp8_block,
                         ExpertMlp.of(config)).blob_bytes


def fixed_bytes_of(model_dir: Path, dtype: str | torch.dtype = "auto",
                   kv_windows: int = DEFAULT_KV_WINDOWS) -> tuple[int, int]:
    """(non-expert weight bytes, default KV pool bytes) of a checkpoint served with this dtype,
    from its tensor shapes, without loading it: the budget rule's other terms for `strata plan`.
    The KV pool is counted in the weight dtype (the GPU backends' activations)."""
    config = load_model_config(Path(model_dir))
    reader = open_checkpoint(Path(model_dir), weight_names(config))
    weight_dtype = resolve_dtype(dtype, reader)
    block = 16
    kv = kv_windows * -(-config.context_window // block) * PagedKVCache.model_bytes_per_block(
        config, block, weight_dtype)
    return non_expert_bytes(reader, weight_dtype, config.num_layers), kv


def non_expert_bytes(reader: CheckpointReader, weight_dtype: torch.dtype,
                     num_layers: int) -> int:
    """Every tensor the model loads but the routed experts (the host store's, per expert or
    stacked; a GGUF reader lists none): a matrix stored in a GGUF block type at its stored
    bytes (the CPU and Triton backends compute on it as stored), the rest in the weight dtype.
    Layers past num_layers (a checkpoint's MTP layers) are not loaded."""
    def loaded(name: str) -> bool:
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        return (".experts." not in name and not name.startswith(NOT_LOADED)
                and (layer is None or int(layer[1]) < num_layers))

    def nbytes(name: str) -> int:
        shape = reader.shape(name)
        stored = BLOCK_TYPES.get(reader.stored_dtype(name)) if len(shape) == 2 else None
        if stored is not None:
            return shape[0] * stored.row_bytes(shape[1])
        return math.prod(shape) * weight_dtype.itemsize

    return sum(nbytes(name) for name in reader.names if loaded(name))


class PromptError(ValueError):
    """A prompt the model cannot take: empty, unknown token ids, or longer than the window."""


class ContextWindowError(PromptError):
    """The sequence would grow past its KV capacity (the context window by default)."""


@dataclass(frozen=True)
class ChunkWork:
    """What the runner needs of one scheduled chunk: positions [pos_start, pos_start + len)."""

    token_ids: abc.Sequence[int]
    pos_start: int
    block_table: abc.Sequence[int]
    prefill: bool  # prompt (or recomputed) tokens: the expert cache counts them apart
    wants_logits: bool  # the chunk ends at the sequence's last token
    num_draft: int = 0  # the last num_draft token_ids are drafts to verify (speculation)
    seq_id: int | None = None  # whose chunk (for a hidden-state sink; None: no one asks)
    every_position: bool = False  # logits at every position (scoring a text), not just the last

    @property
    def num_logits(self) -> int:
        """Rows whose logits the chunk wants: its last token's, plus one per draft (or every
        position's)."""
        if not self.wants_logits:
            return 0
        return len(self.token_ids) if self.every_position else 1 + self.num_draft


def load_line(name: str, device: torch.device, seconds: float, host: HostStore,
              file_bytes: int) -> str:
    """The load's last line: its time against one read of the checkpoint at the rate the host
    store read its experts (the bulk of the file), so a slow load says where it went."""
    line = (f"model {name} ready on {device} in {seconds:.1f} s (host store "
            f"{host.total_bytes / 2**20:.0f} MiB")
    if host.load_seconds <= 0 or not host.total_bytes:
        return line + ")"
    rate = host.total_bytes / host.load_seconds
    one_read = file_bytes / rate
    return (line + f" filled at {rate / 2**20:.0f} MiB/s; one read of the {file_bytes / 2**30:.2f}"
            f" GiB checkpoint at that rate takes {one_read:.1f} s: the load took "
            f"{seconds / max(one_read, 1e-9):.1f}x that)")


class ModelRunner:
    def __init__(
        self,
        model_dir: Path,
        *,
        device: str = "cpu",
        device_memory_bytes: int | None = None,
        reserved_bytes: int = 700 * 2**20,
        cache_slots: int | None = None,
        dtype: str | torch.dtype = "auto",
        policy: PolicySpec | None = None,
        placement: str = DEFAULT_PLACEMENT,
        prefetch: bool | None = None,  # None: on for CUDA, off on the CPU
        record_routing: str | Path | None = None,
        draft_head_bytes: int = 0,
        kv_memory_bytes: int | None = None,
        kv_block_size: int = 16,
        kv_dtype: str = "auto",
        expert_dtype: str = "auto",
        cuda_graphs: bool = True,
        graph_batches: abc.Sequence[int] = DEFAULT_GRAPH_BATCHES,
        cpu_kernels: str = "auto",
        host_memory_bytes: int | None = None,  # host memory to fit (default: MemAvailable)
        max_running: int = 8,  # sequences at once (linear attention's state is budgeted)
    ):
        t0 = time.perf_counter()
        hugepages.request()  # before the first tensor: torch's allocator reads it once
        model_dir = Path(model_dir)
        self.device = torch.device(device)
        if prefetch is None:  # a CPU fill is a memcpy on the compute thread: nothing to win
            prefetch = DEFAULT_PREFETCH and self.device.type == "cuda"
        self.config: ModelConfig = load_model_config(model_dir)
        self.model_name = model_dir.name
        self.model_dir = model_dir
        # Called after each step with (chunks, hidden [T, D] before the final norm): how an
        # MTP draft head (services/engine/spec/mtp.py) sees the main model's hidden states.
        self.hidden_sink: abc.Callable[[abc.Sequence[ChunkWork], torch.Tensor], None] | None = None
        self.step_logits: torch.Tensor | None = None  # the last step's [S, V] (see step)
        self.tokenizer = Tokenizer(model_dir)
        # Free device memory before anything of ours is on it (the budget rule's "free").
        free_bytes = (torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda"
                      else None)
        reader = open_checkpoint(model_dir, weight_names(self.config))
        self.fingerprint = reader.fingerprint(self.config)
        c = self.config
        log.info(
            "loading %s (%s, %d layers, %d experts x %d MoE layers, %d routed; fingerprint "
            "%s) from %s: %d tensors in %d file(s)",
            self.model_name,
            c.model_type,
            c.num_layers,
            c.num_experts,
            len(c.moe_layers),
            c.experts_per_token,
            self.fingerprint,
            model_dir,
            len(reader.names),
            reader.num_files,
        )
        self.backend = select_backend(self.device, cpu_kernels)
        log.info("compute backend: %s", self.backend.describe())
        self.weight_dtype = resolve_dtype(dtype, reader)  # weights, host store, slots
        fmt = expert_format(c.hidden_size, c.moe_intermediate_size, self.weight_dtype,
                            expert_dtype, reader.expert_storage(), reader.fp8_block,
                            ExpertMlp.of(c), inputs_major(
                                c.hidden_size, c.moe_intermediate_size, self.weight_dtype,
                                self.device, self.backend.cpu is not None))
        check_host_memory(c.total_pairs * fmt.blob_bytes,
                          non_expert_bytes(reader, self.weight_dtype, c.num_layers),
                          host_memory_available() if host_memory_bytes is None
                          else host_memory_bytes, fmt.describe())
        self.model = load_model(reader, c, self.backend, self.weight_dtype)
        self.dtype = self.model.dtype  # activations and the KV cache (the backend's choice)
        log.info("weights in %s, activations and KV cache in %s", dtype_name(self.weight_dtype),
                 dtype_name(self.dtype))
        self.num_usable_tokens = min(c.vocab_size, self.tokenizer.vocab_size)
        self.lookups_per_token = c.experts_per_token * len(c.moe_layers)  # each token's a step
        self._setup_kv(kv_memory_bytes, kv_block_size, kv_dtype)

        self.expert_dtype = expert_dtype
        self.slot_bytes = fmt.blob_bytes
        log.info("experts %s: %d bytes per slot (%.2f bits per weight)", fmt.describe(),
                 self.slot_bytes, 8 * self.slot_bytes / (3 * c.hidden_size
                                                        * c.moe_intermediate_size))
        self.total_pairs = c.total_pairs
        self.max_running = max_running
        self.state_bytes = c.linear_state_bytes * max_running  # with the KV pool's bytes
        if self.state_bytes:
            log.info("linear-attention state: %.1f MiB per sequence x %d running = %.0f MiB, "
                     "budgeted with the KV pool", c.linear_state_bytes / 2**20, max_running,
                     self.state_bytes / 2**20)
        self.cache_size = self._size_cache(device_memory_bytes, free_bytes, reserved_bytes,
                                           draft_head_bytes, cache_slots)
        self.slots = self.cache_size.slots
        log.info(self.cache_size.log_line())

        host = HostStore(fmt, self.layer_order_pairs(), pin_memory=self.device.type == "cuda")
        host.load(reader)
        self.policy = policy or PolicySpec()
        residency = Residency(self.slots, self.policy)
        pool = SlotPool(self.slots, host, self.device, residency)
        log.info(
            "cache policy %s: %d pinned + %d dynamic slots%s",
            self.policy.name,
            residency.num_pinned,
            residency.num_dynamic,
            ", next-layer prefetch on" if prefetch else ", prefetch off",
        )
        self.link = probe_link(self.device)
        log.info(self.link.log_line())
        cost = (measure_cost_model(fmt, host, self.link, self.device, self.dtype,
                                   self.backend.cpu)
                if host.pairs else None)
        host_exact = fmt.exact_on(self.device, device_kernel(fmt, self.device) is not None)
        placer = Placer(placement if cost else "host", cost, host_exact)
        log.info(placer.describe())
        recorder = None
        if record_routing is not None:
            recorder = TraceWriter(record_routing, self.trace_meta(prefetch))
            log.info("recording routing to %s", record_routing)
        self.cache = ExpertCache(
            host, pool, c.num_layers, c.num_experts, placer, prefetch=prefetch, recorder=recorder,
            cpu_kernels=self.backend.cpu)
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs and self.device.type == "cuda":
            self._capture_graphs(graph_batches, prefetch)
        if self.device.type == "cpu":
            log.info(hugepages.log_line(self.model.weight_bytes() + host.total_bytes
                                        + self.kv.nbytes))  # the slots fill later
        log.info(load_line(self.model_name, self.device, time.perf_counter() - t0, host,
                           checkpoint_bytes(model_dir)))

    def _setup_kv(self, kv_memory_bytes: int | None, block_size: int, kv_dtype: str) -> None:
        """The paged KV pool, allocated before the expert cache is sized (on CUDA the cache gets
        what is free after it). Default: room for DEFAULT_KV_WINDOWS full context windows."""
        c = self.config
        per_block = PagedKVCache.model_bytes_per_block(c, block_size, self.dtype, kv_dtype)
        window_blocks = -(-c.context_window // block_size)
        if kv_memory_bytes is None:
            num_blocks = DEFAULT_KV_WINDOWS * window_blocks
        else:
            num_blocks = kv_memory_bytes // per_block
            if num_blocks < window_blocks:
                raise ValueError(
                    f"--kv-memory {kv_memory_bytes / 2**20:.0f} MiB holds "
                    f"{num_blocks * block_size} tokens, less than the context window of "
                    f"{c.context_window}; give at least {window_blocks * per_block / 2**20:.0f} MiB")
        self.kv = PagedKVCache.for_model(c, num_blocks, block_size, self.dtype, self.device,
                                         kv_dtype)
        log.info("KV cache: %d blocks of %d positions (%s, %.0f MiB) = %d tokens, %.1f context "
                 "windows", num_blocks, block_size,
                 "int8" if kv_dtype == "int8" else dtype_name(self.dtype),
                 num_blocks * per_block / 2**20, num_blocks * block_size,
                 num_blocks / window_blocks)

    def _capture_graphs(self, batches: abc.Sequence[int], prefetch: bool) -> None:
        """Capture the decode step of each batch size as a CUDA graph, now, before serving;
        or say why this model or cache cannot be captured."""
        blocker = graph_blocker(self.model, self.kv, self.cache)
        if blocker is not None:
            log.info("decode steps as CUDA graphs: off (%s)", blocker)
            return
        t0 = time.perf_counter()
        self.graphs = DecodeGraphs(self.model, self.kv, self.cache)
        self.graphs.capture(batches)
        sizes = sorted(self.graphs.graphs)
        log.info("decode steps as CUDA graphs: captured batch sizes %s in %.1f s; other "
                 "sizes and steps that are not pure decode run eagerly",
                 f"{sizes[0]}-{sizes[-1]}" if sizes == list(range(sizes[0], sizes[-1] + 1))
                 else ",".join(map(str, sizes)), time.perf_counter() - t0)
        if prefetch:
            log.info("next-layer prefetch runs in eager steps only (prefill, mixed batches): "
                     "a graphed decode step has no point where a fill could start before the "
                     "layer that needs it")

    def trace_meta(self, prefetch: bool) -> dict:
        """The metadata a routing trace of this runner carries."""
        c, p = self.config, self.policy
        return {
            "format": "strata routing trace",
            "model": self.model_name,
            "fingerprint": self.fingerprint,
            "num_layers": c.num_layers,
            "num_experts": c.num_experts,
            "moe_layers": list(c.moe_layers),
            "total_pairs": self.total_pairs,
            "experts_per_token": c.experts_per_token,
            "slots": self.slots,
            "policy": p.name,
            "pinned_fraction": p.pinned_fraction,
            "crf_lambda": p.crf_lambda,
            "admit_prefill": p.admit_prefill,
            "prefetch": prefetch,
        }

    def _size_cache(self, configured: int | None, free: int | None, reserved: int,
                    draft: int, cache_slots: int | None) -> CacheSize:
        """The one budget rule (services/common/sizing.py) with this engine's terms. On CPU
        without a budget, --cache-slots alone sizes the cache (the budget is what it takes)."""
        terms = {"weight_bytes": self.model.weight_bytes(),
                 "kv_bytes": self.kv.nbytes + self.state_bytes}  # sequence memory
        if configured is None and free is None:
            if cache_slots is None:
                raise ValueError("device_memory_bytes is required on CPU (it stands in for "
                                 "free VRAM), or cache_slots")
            configured = (sum(terms.values()) + draft + reserved
                          + min(cache_slots, self.total_pairs) * self.slot_bytes)
        size = size_cache(device_limit(configured, free), reserved, self.slot_bytes,
                          self.total_pairs, draft, free_bytes=free, configured_bytes=configured,
                          slots=cache_slots, **terms)
        size.check()
        return size

    def layer_order_pairs(self) -> list[tuple[int, int]]:
        """Every pair in layer order: (0, 0), (0, 1), ... — the default ranking."""
        return [
            (layer, e) for layer in self.config.moe_layers for e in range(self.config.num_experts)
        ]

    def fill_cache(
        self, ranked_pairs: abc.Sequence[tuple[int, int]], source: str = "ranking"
    ) -> FillReport:
        """Copy the first `slots` distinct pairs of the ranking into the slot pool (the first
        `num_pinned` of them pinned; the dynamic region starts over); the whole ranking goes
        into the routing trace. Call between steps (a plan revision, say)."""
        ranked_pairs = [(int(layer), int(e)) for layer, e in ranked_pairs]
        self.cache.quiesce()  # no fill of the old residency may land after the new one's
        if self.cache.recorder is not None:
            self.cache.recorder.fill_record(ranked_pairs)
        report = self.cache.pool.fill(ranked_pairs, source=source)
        self.cache.refresh_addresses()
        (log.info if report.verified else log.error)(report.log_line())
        return report

    # -- one step over many sequences (continuous batching) ---------------------------------
    @torch.no_grad()
    def step(self, chunks: abc.Sequence[ChunkWork], experts: ExpertSource | None = None
             ) -> list[tuple[torch.Tensor | None, CacheCounters]]:
        """One forward pass over every chunk; per chunk: fp32 logits (for chunks that want
        them, else None) and its expert-cache figures. Logits are [V] for a plain chunk and
        [1 + num_draft, V] for a verification chunk (row i: the distribution after its i-th
        draft; row 0: after its last real token), [T, V] for an every-position one: views of
        `step_logits` [S, V], the chunks' rows in order. Lookups, hits and misses by placement
        are exact per chunk; prefetch figures are the step's, shared by its decode chunks.
        `experts` stands in for the expert cache as the MoE blocks' source (a routing tap
        that wraps it, say)."""
        ids, positions, spans, prefill_rows, logit_rows = [], [], [], [], []
        for chunk in chunks:
            row = len(ids)
            n = len(chunk.token_ids)
            ids.extend(chunk.token_ids)
            positions.extend(range(chunk.pos_start, chunk.pos_start + n))
            spans.append(Span(row, row + n, chunk.pos_start, chunk.block_table,
                              -1 if chunk.seq_id is None else chunk.seq_id, chunk.num_draft))
            prefill_rows.extend([chunk.prefill] * n)
            logit_rows.extend(range(row + n - chunk.num_logits, row + n))
        self.cache.begin_step(len(ids), np.array(prefill_rows, dtype=bool))
        d = self.cache.decode
        predictions = (d.predicted, d.predicted_routed, d.routed_with_prediction)
        rows = np.array((ids, positions), dtype=np.int64)  # (one conversion from lists)
        token_ids = torch.from_numpy(rows[0])  # [T] (the model moves what it needs)
        pos = torch.from_numpy(rows[1])  # [T]
        logits = None
        if (self.graphs is not None and experts is None
                and len(logit_rows) == len(ids) == len(spans)):
            logits = self.graphs.run(token_ids, pos, spans)  # pure decode: a replay, if captured
        if logits is None:
            every_row = len(logit_rows) == len(ids)  # (rows ascend, none twice: all of them)
            logits = self.model.forward(  # [S, V]
                token_ids, pos, spans, self.kv, experts or self.cache,
                None if every_row else torch.tensor(logit_rows, dtype=torch.long))
        if self.num_usable_tokens < logits.shape[1]:
            logits[:, self.num_usable_tokens:] = float("-inf")
        self.step_logits = logits
        if self.hidden_sink is not None:
            self.hidden_sink(chunks, self.model.last_hidden)
        predicted, predicted_routed, routed_with_prediction = (
            now - then for now, then in zip(
                (d.predicted, d.predicted_routed, d.routed_with_prediction), predictions,
                strict=True))
        results: list[tuple[torch.Tensor | None, CacheCounters]] = []
        next_row = 0
        starts = [span.row_start for span in spans]  # each chunk's rows summed at once
        hits, host, copied = np.add.reduceat(self.cache.step_tokens, starts, axis=1).tolist()
        for i, (chunk, span) in enumerate(zip(chunks, spans, strict=True)):
            counters = CacheCounters(
                lookups=self.lookups_per_token * (span.row_end - span.row_start), hits=hits[i],
                misses_host=host[i], misses_copied=copied[i])
            if not chunk.prefill:
                counters.predicted = predicted
                counters.predicted_routed = predicted_routed
                counters.routed_with_prediction = routed_with_prediction
            rows_logits = None
            if chunk.wants_logits:
                rows_logits = (logits[next_row:next_row + chunk.num_logits]  # [num_logits, V]
                               if chunk.num_draft or chunk.every_position else logits[next_row])
                next_row += chunk.num_logits
            results.append((rows_logits, counters))
        return results

    def check_prompt(self, prompt_ids: abc.Sequence[int], capacity: int) -> None:
        """Raise PromptError for a prompt the model cannot take within `capacity` positions."""
        window = self.config.context_window
        if not prompt_ids:
            raise PromptError("the prompt is empty")
        if len(prompt_ids) > capacity:
            raise ContextWindowError(f"prompt of {len(prompt_ids)} tokens exceeds the "
                                     f"{capacity}-token limit (context window {window})")
        bad = [t for t in prompt_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise PromptError(
                f"token id {bad[0]} outside the vocabulary of {self.config.vocab_size}")

    @property
    def per_sequence_state(self) -> bool:
        """Whether layers keep state per sequence outside the paged KV (linear attention)."""
        return bool(self.model.per_sequence)

    def rewind(self, seq_id: int, num_computed: int) -> None:
        """After a verification step: the sequence's computed positions end at num_computed
        (the rejected drafts' are recomputed later); per-sequence state goes back to there."""
        self.model.rewind(seq_id, num_computed)

    def release(self, seq_id: int) -> None:
        """The sequence finished or was preempted: layers that keep per-sequence state (beyond
        the paged KV, which its block manager frees) drop it; the routing trace is flushed."""
        self.model.release(seq_id)
        if self.cache.recorder is not None:
            self.cache.recorder.flush()

    def cache_totals(self) -> tuple[CacheCounters, CacheCounters]:
        """Lifetime (decode, prefill) counters of the expert cache."""
        return self.cache.decode, self.cache.prefill

    def close(self) -> None:
        """Flush and close the routing trace, if one is being recorded."""
        if self.cache.recorder is not None:
            self.cache.recorder.close()

    def take_routing_counts(self) -> np.ndarray:
        """Per-pair routing counts [L, E] int64 since the last call; then resets."""
        return self.cache.take_routing_counts()

    def take_phase_routing_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """(all, decode-only) per-pair routing counts [L, E] since the last call; resets both."""
        return self.cache.take_phase_routing_counts()
