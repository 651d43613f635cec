"""Sequences run through a model runner outside the engine's loop: tools, benches and tests.

    SequenceDriver(runner): start(prompt) -> prefill(seq) -> decode(seq, token)... -> release(seq)
                            decode_batch(seqs, tokens): one step over several sequences
                            score(token_ids): logits at every position of one text

It drives the forward pass the way the engine does (services/engine/core.py): the scheduler's
sequence state and chunks, `chunk_work` to turn a chunk into the runner's ChunkWork, blocks
from a BlockManager over the runner's KV pool, `ModelRunner.step` for the forward, and
`ModelRunner.release` when a sequence ends. What it leaves out is the scheduling: the caller
says which sequence runs which tokens. One block manager per KV pool: the driver claims the
pool (the engine claims it for its scheduler), and `close` hands it back.
"""

from __future__ import annotations

import itertools
from collections import abc
from dataclasses import dataclass, field

import torch

from services.common.counters import PhaseCounters
from services.engine.block_manager import BlockManager, BlockTable
from services.engine.model.step import ExpertSource
from services.engine.runner import ChunkWork, ContextWindowError, ModelRunner
from services.engine.scheduler import Chunk, SeqState


def chunk_work(chunk: Chunk, every_position: bool = False, logits: bool | None = None
               ) -> ChunkWork:
    """The runner's view of a scheduled chunk. A single new token past the prompt is decode;
    anything else (prompt tokens, a preempted sequence's recomputation) counts as prefill.
    It wants logits when it reaches the sequence's last token, unless `logits` says."""
    seq = chunk.seq
    assert seq.table is not None, f"sequence {seq.seq_id} holds no KV blocks"
    return ChunkWork([*seq.token_ids[chunk.start:chunk.end], *chunk.draft], chunk.start,
                     seq.table.block_ids,
                     prefill=not (chunk.end - chunk.start == 1 and chunk.start >= seq.prompt_len),
                     wants_logits=chunk.samples if logits is None else logits,
                     num_draft=len(chunk.draft), seq_id=seq.seq_id,
                     every_position=every_position)


@dataclass(eq=False)
class Sequence(SeqState):
    max_num_tokens: int = 0  # KV capacity
    stats: PhaseCounters = field(default_factory=PhaseCounters)  # its expert-cache figures


class SequenceDriver:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        runner.kv.claim(self)
        # No prefix reuse: the caller decides what runs, so every position is computed.
        self.blocks = BlockManager(runner.kv.num_blocks, runner.kv.block_size,
                                   enable_prefix_reuse=False)
        self._seq_ids = itertools.count()

    @property
    def holds_kv(self) -> bool:
        return self.blocks.num_free_blocks < self.blocks.num_blocks

    def close(self) -> None:
        """Hand the KV pool back (every sequence must have been released)."""
        assert not self.holds_kv, "sequences still live"
        self.runner.kv.claim(None)

    def start(self, prompt_ids: abc.Sequence[int], max_num_tokens: int | None = None
              ) -> Sequence:
        """A new sequence with KV room for max_num_tokens (default: the context window)."""
        window = self.runner.config.context_window
        capacity = window if max_num_tokens is None else min(max_num_tokens, window)
        self.runner.check_prompt(prompt_ids, capacity)
        return Sequence(next(self._seq_ids), list(prompt_ids), len(prompt_ids),
                        table=BlockTable(), max_num_tokens=capacity)

    def prefill(self, seq: Sequence, max_tokens: int | None = None) -> torch.Tensor:
        """Run the not-yet-computed tokens (at most max_tokens of them: chunked prefill; call
        again until seq.num_computed == seq.num_tokens); fp32 logits [V] of the last one run."""
        assert seq.num_pending > 0, "nothing to prefill"
        end = seq.num_tokens if max_tokens is None else min(seq.num_tokens,
                                                             seq.num_computed + max_tokens)
        [logits] = self.run([(seq, end)])
        return logits

    def decode(self, seq: Sequence, token_id: int) -> torch.Tensor:
        """Append token_id and run it; fp32 logits [V] of the next position."""
        [logits] = self.decode_batch([seq], [token_id])
        return logits

    def decode_batch(self, seqs: abc.Sequence[Sequence], token_ids: abc.Sequence[int]
                     ) -> list[torch.Tensor]:
        """Append one token to each sequence and run them in one step; logits [V] each."""
        for seq, token in zip(seqs, token_ids, strict=True):
            assert seq.num_pending == 0, "decode() before prefill() finished the prompt"
            if seq.num_tokens >= seq.max_num_tokens:
                raise ContextWindowError(f"sequence reached its {seq.max_num_tokens}-token limit")
            seq.token_ids.append(int(token))
        return self.run([(seq, seq.num_tokens) for seq in seqs])

    def run(self, work: abc.Sequence[tuple[Sequence, int]], every_position: bool = False,
            experts: ExpertSource | None = None) -> list[torch.Tensor]:
        """One step: each sequence's positions [num_computed, end), in that order; the logits
        of each chunk's last position ([V]), or of every position ([T, V])."""
        chunks = []
        for seq, end in work:
            assert seq.table is not None, f"sequence {seq.seq_id} was released"
            self.blocks.append(seq.table, end)
            chunks.append(Chunk(seq, seq.num_computed, end))
        # Logits for every chunk, also a prefill chunk short of the prompt's end.
        works = [chunk_work(c, every_position, logits=True) for c in chunks]
        out = []
        for (seq, end), w, (logits, counters) in zip(work, works, self.runner.step(works, experts),
                                                     strict=True):
            seq.num_computed = end
            seq.stats.add(counters, prefill=w.prefill)
            assert logits is not None
            out.append(logits)
        return out

    def score(self, token_ids: abc.Sequence[int], experts: ExpertSource | None = None
              ) -> torch.Tensor:
        """fp32 logits [T, V] at every position of one fresh sequence (one prefill step)."""
        seq = self.start(token_ids)
        try:
            [logits] = self.run([(seq, seq.num_tokens)], every_position=True, experts=experts)
        finally:
            self.release(seq)
        return logits

    def release(self, seq: Sequence) -> None:
        if seq.table is not None:
            self.blocks.free(seq.table)
            seq.table = None
        self.runner.release(seq.seq_id)
