"""ModelRunner: the engine's tensor side — checkpoint, expert cache, per-sequence KV and steps.

    checkpoint ─┬─> non-expert weights (device) ── Qwen3MoeModel.forward ──> logits [V]
                └─> HostStore (every pair) ──fill──> SlotPool (S slots, device)
                          ExpertCache.route: Residency (pinned core + dynamic region) per step,
                          misses placed on the host or copied (cost model), next-layer prefetch

The cache is sized with services.common.sizing.size_cache from the free device memory (CUDA)
or an explicit budget (CPU), after the non-expert weights are on the device. At start a link
probe and timed expert runs feed the miss-placement cost model.
Logits of ids the tokenizer does not know (vocab padding) are masked to -inf.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import abc
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from services.common.sizing import CacheSize, size_cache
from services.engine.cache.expert_cache import ExpertCache
from services.engine.cache.host_store import HostStore
from services.engine.cache.layout import ExpertLayout
from services.engine.cache.placement import (
    DEFAULT_PLACEMENT,
    CostModel,
    LinkProbe,
    Placer,
    probe_link,
    time_expert,
)
from services.engine.cache.policy import DEFAULT_PREFETCH, PolicySpec, Residency
from services.engine.cache.slot_pool import FillReport, SlotPool
from services.engine.cache.stats import CacheCounters
from services.engine.cache.trace import TraceWriter
from services.engine.model.checkpoint import CheckpointReader
from services.engine.model.config import ModelConfig, load_model_config
from services.engine.model.qwen3_moe import KVCache, load_qwen3_moe
from services.engine.model.tokenizer import Tokenizer

log = logging.getLogger("strata.engine")


class PromptError(ValueError):
    """A prompt the model cannot take: empty, unknown token ids, or longer than the window."""


class ContextWindowError(PromptError):
    """The sequence would grow past its KV capacity (the context window by default)."""


@dataclass
class RoutingStats:
    """Expert-cache figures of one sequence, per phase; the unprefixed ones are the decode's."""

    decode: CacheCounters = field(default_factory=CacheCounters)
    prefill: CacheCounters = field(default_factory=CacheCounters)

    @property
    def lookups(self) -> int:
        return self.decode.lookups

    @property
    def hits(self) -> int:
        return self.decode.hits

    @property
    def spilled(self) -> int:
        return self.decode.spilled

    @property
    def prefill_lookups(self) -> int:
        return self.prefill.lookups

    @property
    def prefill_hits(self) -> int:
        return self.prefill.hits

    @property
    def hit_rate(self) -> float:
        return self.decode.hit_rate


@dataclass
class Sequence:
    seq_id: int
    token_ids: list[int]
    prompt_len: int
    max_num_tokens: int  # KV capacity
    kv: list[KVCache]
    num_cached: int = 0  # tokens whose K/V are in the cache
    stats: RoutingStats = field(default_factory=RoutingStats)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class ModelRunner:
    def __init__(
        self,
        model_dir: Path,
        *,
        device: str = "cpu",
        device_memory_bytes: int | None = None,
        reserved_bytes: int = 700 * 2**20,
        dtype: torch.dtype = torch.float32,
        policy: PolicySpec | None = None,
        placement: str = DEFAULT_PLACEMENT,
        prefetch: bool = DEFAULT_PREFETCH,
        record_routing: str | Path | None = None,
        draft_head_bytes: int = 0,
    ):
        t0 = time.perf_counter()
        model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.dtype = dtype
        self.config: ModelConfig = load_model_config(model_dir)
        self.model_name = model_dir.name
        self.tokenizer = Tokenizer(model_dir)
        reader = CheckpointReader(model_dir)
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
        self.model = load_qwen3_moe(reader, c, self.device, dtype)
        self.num_usable_tokens = min(c.vocab_size, self.tokenizer.vocab_size)

        layout = ExpertLayout(c.hidden_size, c.moe_intermediate_size)
        self.slot_bytes = layout.blob_bytes(dtype)
        self.total_pairs = c.total_pairs
        free_bytes = self._free_bytes(device_memory_bytes)
        self.cache_size: CacheSize = size_cache(
            free_bytes, reserved_bytes, self.slot_bytes, self.total_pairs, draft_head_bytes
        )
        self.slots = self.cache_size.slots
        log.info(self.cache_size.log_line())

        host = HostStore(
            layout, self.layer_order_pairs(), dtype, pin_memory=self.device.type == "cuda"
        )
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
        cost = self._cost_model(layout, host, self.link) if host.pairs else None
        placer = Placer(placement if cost else "host", cost, self.device.type == "cuda")
        log.info(placer.describe())
        recorder = None
        if record_routing is not None:
            recorder = TraceWriter(record_routing, self.trace_meta(prefetch))
            log.info("recording routing to %s", record_routing)
        self.cache = ExpertCache(
            host, pool, c.num_layers, c.num_experts, placer, prefetch=prefetch, recorder=recorder
        )
        self._seq_ids = itertools.count()
        log.info(
            "model %s ready on %s in %.1f s (host store %.0f MiB)",
            self.model_name,
            self.device,
            time.perf_counter() - t0,
            host.total_bytes / 2**20,
        )

    def _cost_model(self, layout: ExpertLayout, host: HostStore, link: LinkProbe) -> CostModel:
        """Measured host and device expert speeds (the same on CPU) for miss placement."""
        pair = host.pairs[0]
        host_timing = time_expert(layout, host.blob(pair))
        device_timing, activation_s = host_timing, 0.0
        if self.device.type == "cuda":
            device_timing = time_expert(layout, host.blob(pair).to(self.device))
            x = torch.zeros(1, layout.hidden_size, dtype=self.dtype, device=self.device)
            torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            for _ in range(5):
                x = x.cpu().to(self.device)
            torch.cuda.synchronize(self.device)
            activation_s = (time.perf_counter() - t0) / 5
        log.info(
            "host expert throughput: %.0f tokens/s for one expert at 1 token (%.3f ms), "
            "%.0f tokens/s at 16 tokens",
            host_timing.tokens_per_s,
            host_timing.seconds(1) * 1e3,
            16 / host_timing.seconds(16),
        )
        return CostModel(self.slot_bytes, link.bytes_per_s, host_timing, device_timing,
                         activation_s)

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

    def _free_bytes(self, device_memory_bytes: int | None) -> int:
        if device_memory_bytes is not None:
            return device_memory_bytes
        if self.device.type == "cuda":
            return torch.cuda.mem_get_info(self.device)[0]
        raise ValueError("device_memory_bytes is required on CPU (it stands in for free VRAM)")

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
        (log.info if report.verified else log.error)(report.log_line())
        return report

    def start(self, prompt_ids: list[int], max_num_tokens: int | None = None) -> Sequence:
        """A new sequence with KV room for max_num_tokens (default: the context window)."""
        window = self.config.context_window
        capacity = window if max_num_tokens is None else min(max_num_tokens, window)
        if not prompt_ids:
            raise PromptError("the prompt is empty")
        if len(prompt_ids) > capacity:
            raise ContextWindowError(
                f"prompt of {len(prompt_ids)} tokens exceeds the "
                f"{capacity}-token limit (context window {window})"
            )
        bad = [t for t in prompt_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise PromptError(
                f"token id {bad[0]} outside the vocabulary of {self.config.vocab_size}"
            )
        return Sequence(
            seq_id=next(self._seq_ids),
            token_ids=list(prompt_ids),
            prompt_len=len(prompt_ids),
            max_num_tokens=capacity,
            kv=self.model.setup_caches(capacity),
        )

    def prefill(self, seq: Sequence, max_tokens: int | None = None) -> torch.Tensor:
        """Run the not-yet-cached tokens (at most max_tokens of them: chunked prefill; call
        again until seq.num_cached == seq.num_tokens); fp32 logits [V] of the last one run."""
        assert seq.num_cached < seq.num_tokens, "nothing to prefill"
        end = (
            seq.num_tokens
            if max_tokens is None
            else min(seq.num_tokens, seq.num_cached + max_tokens)
        )
        before = self.cache.prefill.copy()
        logits = self._forward(seq, seq.token_ids[seq.num_cached : end], prefill=True)
        seq.stats.prefill.add(self.cache.prefill.since(before))
        return logits

    def decode(self, seq: Sequence, token_id: int) -> torch.Tensor:
        """Append token_id and run it; fp32 logits [V] of the next position."""
        assert seq.kv, f"sequence {seq.seq_id} was released"
        assert seq.num_cached == seq.num_tokens, "decode() before prefill() finished the prompt"
        if seq.num_tokens >= seq.max_num_tokens:
            raise ContextWindowError(f"sequence reached its {seq.max_num_tokens}-token limit")
        seq.token_ids.append(int(token_id))
        before = self.cache.decode.copy()
        logits = self._forward(seq, seq.token_ids[-1:], prefill=False)
        seq.stats.decode.add(self.cache.decode.since(before))
        return logits

    @torch.no_grad()
    def _forward(self, seq: Sequence, token_ids: list[int], prefill: bool) -> torch.Tensor:
        assert seq.kv, f"sequence {seq.seq_id} was released"
        self.cache.begin_step(len(token_ids), prefill)
        start = seq.num_cached
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)  # [T]
        pos = torch.arange(start, start + len(token_ids), device=self.device)  # [T]
        logits = self.model.forward(ids, pos, seq.kv, self.cache)  # [V]
        seq.num_cached = start + len(token_ids)
        logits[self.num_usable_tokens :] = float("-inf")
        return logits

    def release(self, seq: Sequence) -> None:
        seq.kv = []
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
