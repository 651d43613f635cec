"""A separate small draft model (same tokenizer): k greedy tokens per sequence and step.

    propose: per sequence, catch its draft KV up with the target's tokens (the longest prefix it
             already computed is kept: accepted drafts keep their K/V, rejected ones are
             recomputed), then k-1 single-token steps; every round is ONE batched forward of the
             draft model for all sequences (services.engine.runner.ModelRunner.step).

The draft runs in its own ModelRunner: its own paged KV pool and its own expert cache with every
(layer, expert) pair resident, so its lookups never touch the target's cache or figures; they
are reported as `draft_lookups`. Its device memory (its tensors' shapes plus its KV pool) is
known before the target sizes its cache (`memory_bytes`, the "+N MiB for the draft head" of the
start-up line).
Proposals are greedy, so a proposal is a deterministic function of the tokens, as the acceptance
rule for point-mass drafts needs (services/engine/spec/verify.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from services.engine.block_manager import BlockManager, BlockTable, NoFreeBlocks
from services.engine.model.checkpoint import load_model_config, open_checkpoint
from services.engine.model.families import weight_names
from services.engine.model.paged_kv import PagedKVCache
from services.engine.sampling import argmax_ids
from services.engine.spec.base import DraftRequest, DraftSource

DRAFT_KV_WINDOWS = 4  # the draft's KV pool: this many of its context windows


def draft_model_bytes(
    model_dir: Path, dtype: torch.dtype = torch.float32, kv_windows: int = DRAFT_KV_WINDOWS
) -> int:
    """Device bytes of a draft model: every weight (all experts resident; counted from the
    checkpoint's tensor shapes, whatever the family) plus its KV pool."""
    c = load_model_config(model_dir)
    reader = open_checkpoint(model_dir, weight_names(c))
    params = sum(math.prod(reader.shape(name)) for name in reader.names)
    element = torch.empty((), dtype=dtype).element_size()
    block_size = 16
    kv_blocks = kv_windows * -(-c.context_window // block_size)
    kv = kv_blocks * PagedKVCache.model_bytes_per_block(c, block_size, dtype)
    return params * element + kv


@dataclass
class _DraftSeq:
    token_ids: list[int] = field(default_factory=list)  # what the draft's KV was computed for
    num_computed: int = 0
    table: BlockTable = field(default_factory=BlockTable)


class DraftModel(DraftSource):
    method = "draft"

    def __init__(self, runner: Any, memory_bytes: int = 0):
        self.runner = runner  # services.engine.runner.ModelRunner of the draft checkpoint
        self.memory_bytes = memory_bytes
        runner.kv.claim(self)  # its blocks follow each target sequence's computed prefix
        self.blocks = BlockManager(runner.kv.num_blocks, runner.kv.block_size,
                                   enable_prefix_reuse=False)
        self._seqs: dict[int, _DraftSeq] = {}

    @classmethod
    def load(
        cls,
        model_dir: Path,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> DraftModel:
        from services.engine.runner import ModelRunner

        probe_bytes = draft_model_bytes(model_dir, dtype)
        runner = ModelRunner(
            model_dir,
            device=device,
            dtype=dtype,
            reserved_bytes=0,
            cache_slots=load_model_config(model_dir).total_pairs,  # in the main one's reserve
            prefetch=False,
        )
        runner.fill_cache(runner.layer_order_pairs(), source="draft model: every pair")
        return cls(runner, probe_bytes)

    holds_kv = True  # bound to its runner for life

    def check_tokenizer(self, tokenizer: Any) -> None:
        """The draft must share the target's tokenizer (the same ids mean the same text)."""
        mine = self.runner.tokenizer
        sample = "def f(x):\n    return x + 1  # ünïcode"
        if mine.vocab_size != tokenizer.vocab_size or mine.encode(sample) != tokenizer.encode(
            sample
        ):
            raise ValueError(
                f"the draft model {self.runner.model_name} does not share the target's tokenizer"
            )

    @property
    def draft_lookups(self) -> int:  # type: ignore[override]
        return self.runner.cache.lookups

    def describe(self) -> str:
        c = self.runner.config
        return (
            f"draft model {self.runner.model_name} ({c.num_layers} layers, {c.num_experts} "
            f"experts, {self.memory_bytes / 2**20:.0f} MiB)"
        )

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        live = [i for i, r in enumerate(requests) if r.max_tokens > 0 and self._sync(r)]
        rounds = max((requests[i].max_tokens for i in live), default=0)
        for k in range(rounds):
            active = [i for i in live if requests[i].max_tokens > k]
            work = [self._chunk(requests[i], drafts[i]) for i in active]
            results = self.runner.step(work)
            for i, w, (logits, _) in zip(active, work, results, strict=True):
                st = self._seqs[requests[i].seq_id]
                st.token_ids[w.pos_start :] = w.token_ids
                st.num_computed = w.pos_start + len(w.token_ids)
                [token] = argmax_ids(logits)  # logits [V]
                drafts[i].append(token)
        return drafts

    def release(self, seq_id: int) -> None:
        st = self._seqs.pop(seq_id, None)
        if st is not None:
            self.blocks.free(st.table)

    def _sync(self, r: DraftRequest) -> bool:
        """Keep the longest computed prefix equal to the target's tokens; room for k-1 more."""
        st = self._seqs.setdefault(r.seq_id, _DraftSeq())
        tokens = r.token_ids
        n = 0
        limit = min(st.num_computed, len(tokens) - 1)  # the last token runs again: its logits
        while n < limit and st.token_ids[n] == tokens[n]:
            n += 1
        st.num_computed = n
        del st.token_ids[n:]
        need = len(tokens) + r.max_tokens - 1
        if need > self.runner.config.context_window:
            return False
        try:
            self.blocks.append(st.table, need)
        except NoFreeBlocks:
            self.release(r.seq_id)
            return False
        return True

    def _chunk(self, r: DraftRequest, drafted: list[int]) -> Any:
        from services.engine.runner import ChunkWork

        st = self._seqs[r.seq_id]
        if drafted:  # later rounds: the previous draft token alone
            tokens, start = [drafted[-1]], len(r.token_ids) + len(drafted) - 1
        else:  # first round: catch up with the target
            tokens, start = list(r.token_ids[st.num_computed :]), st.num_computed
        return ChunkWork(
            tokens, start, st.table.block_ids, prefill=len(tokens) > 1, wants_logits=True
        )
