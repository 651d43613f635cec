"""Continuous batching: which tokens of which sequences run in the next engine step.

    waiting (FIFO) ──admit: a running place + KV blocks──> running ──finish / cancel──> blocks freed

Each step every running sequence in decode contributes its one new token; sequences still in
prefill then contribute chunks, in admission order, until the step's token budget is spent; then
waiting sequences are admitted while places, blocks and budget last (a prompt that starts with
part of a cached block gets a copy of that block's K/V first: `Step.copies`, which the engine has
the runner make before the forward). So a long prompt is cut into chunks and never freezes the
others. When a growing sequence needs a KV block and none is free, the most recently admitted
sequence is preempted: its blocks are freed and it goes back to the front of the queue, to be
recomputed (prefix reuse usually finds its blocks again).

Speculative decoding: a decoding sequence may carry `draft` tokens (set by the engine before
`schedule`). Its decode chunk then also covers the draft's positions, so one forward verifies
them; KV blocks for those positions are taken only while free blocks last (a draft never
preempts anyone) and the draft is cut to the blocks and the step's token budget. After the
verification `accept_draft` keeps the K/V of the accepted drafts and releases the blocks that
only rejected positions used; rejected positions are simply recomputed (overwritten) later, and
prefix hashes only ever cover computed, accepted tokens.

Plain Python over lists and ids: no torch here. The runner turns a `Step` into one forward pass.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.engine.block_manager import BlockManager, BlockTable


@dataclass(eq=False)
class SeqState:
    seq_id: int
    token_ids: list[int]  # prompt, then generated tokens as they are sampled
    prompt_len: int
    arrived_at: float | None = None  # set by Scheduler.add
    payload: Any = None  # the engine's per-request state
    table: BlockTable | None = None
    num_computed: int = 0  # positions whose K/V are in the cache
    num_reused: int = 0  # prompt tokens served from the prefix cache at first admission
    admitted_at: float | None = None
    num_preemptions: int = 0
    cancelled: bool = False
    draft: list[int] = field(default_factory=list)  # proposed tokens to verify next step
    reuse_prefix: bool = True  # False: every prompt position is computed (prompt logprobs)
    max_chunk: int = 0  # most positions of one prefill chunk (0: the step's budget)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def wait_s(self) -> float:
        if self.arrived_at is None or self.admitted_at is None:
            return 0.0
        return self.admitted_at - self.arrived_at


@dataclass(frozen=True)
class Chunk:
    """Positions [start, end) of one sequence, computed in this step; a decode chunk may also
    carry draft tokens for positions [end, end + len(draft)), verified in the same forward."""

    seq: SeqState
    start: int
    end: int
    draft: tuple[int, ...] = ()

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last token, so its logits give the next token."""
        return self.end == self.seq.num_tokens

    @property
    def num_positions(self) -> int:
        return self.end - self.start + len(self.draft)


@dataclass(frozen=True)
class Step:
    chunks: tuple[Chunk, ...] = ()
    preempted: tuple[SeqState, ...] = ()
    dropped: tuple[SeqState, ...] = ()  # cancelled sequences whose blocks were freed
    # (source, destination) KV blocks to copy before the forward: admitted prompts that start
    # with part of a cached block (BlockTable.copy_from)
    copies: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(c.num_positions for c in self.chunks)


@dataclass
class Scheduler:
    blocks: BlockManager
    max_running: int
    max_step_tokens: int  # token budget of one step; also the prefill chunk size
    clock: Callable[[], float] = time.monotonic
    waiting: collections.deque[SeqState] = field(default_factory=collections.deque)
    running: list[SeqState] = field(default_factory=list)  # admission order

    def __post_init__(self) -> None:
        assert self.max_running >= 1 and self.max_step_tokens >= self.max_running

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: SeqState) -> None:
        if seq.arrived_at is None:
            seq.arrived_at = self.clock()
        self.waiting.append(seq)

    def schedule(self) -> Step:
        dropped = self._drop_cancelled()
        for seq in self.running:
            if seq.num_pending != 1:
                seq.draft = []  # only decoding sequences verify drafts
        preempted = self._grow_decodes()
        budget = self.max_step_tokens
        chunks: list[Chunk] = []
        decoding = [s for s in self.running if s.num_pending == 1]
        budget -= len(decoding)
        for seq in decoding:  # decodes first: one token each, plus drafts while budget lasts
            draft = tuple(seq.draft[:max(0, budget)])
            budget -= len(draft)
            chunks.append(Chunk(seq, seq.num_computed, seq.num_tokens, draft))
        for seq in self.running:  # then prefill chunks, oldest first
            if seq.num_pending > 1 and budget > 0:
                chunks.append(self._prefill_chunk(seq, budget))
                budget -= chunks[-1].end - chunks[-1].start
        copies = []
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            if not self.blocks.can_allocate(seq.token_ids, reuse=seq.reuse_prefix):
                break  # FIFO: the head waits for blocks; nobody overtakes it
            self.waiting.popleft()
            self._admit(seq)
            assert seq.table is not None
            if seq.table.copy_from is not None:
                copies.append(seq.table.copy_from)
                seq.table.copy_from = None
            chunks.append(self._prefill_chunk(seq, budget))
            budget -= chunks[-1].end - chunks[-1].start
        return Step(tuple(chunks), tuple(preempted), tuple(dropped), tuple(copies))

    def complete(self, step: Step) -> None:
        """The step's forward pass ran: its positions now have K/V in the cache."""
        for chunk in step.chunks:
            seq = chunk.seq
            seq.num_computed = chunk.end
            assert seq.table is not None
            self.blocks.mark_computed(seq.table, seq.token_ids, seq.num_computed)

    def accept_draft(self, seq: SeqState, num_accepted: int) -> None:
        """After a verification step (and `complete`): the first num_accepted drafts, now in
        seq.token_ids, have their K/V computed; blocks beyond the sequence's tokens, which only
        rejected positions used, go back to the free list."""
        assert seq.table is not None and seq.num_computed + num_accepted < seq.num_tokens
        seq.num_computed += num_accepted
        seq.draft = []
        self.blocks.mark_computed(seq.table, seq.token_ids, seq.num_computed)
        self.blocks.trim(seq.table, seq.num_tokens)

    def finish(self, seq: SeqState) -> None:
        """The sequence is done (or failed): free its blocks; they stay reusable until evicted."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.table is not None:
            self.blocks.free(seq.table, seq.token_ids, seq.num_computed)
            seq.table = None

    # -- internals -----------------------------------------------------------------------------
    def _admit(self, seq: SeqState) -> None:
        seq.table = self.blocks.allocate(seq.token_ids, reuse=seq.reuse_prefix)
        seq.num_computed = seq.table.num_reused_tokens
        if seq.admitted_at is None:
            seq.admitted_at = self.clock()
            seq.num_reused = seq.table.num_reused_tokens
        self.running.append(seq)

    def _prefill_chunk(self, seq: SeqState, budget: int) -> Chunk:
        end = min(seq.num_tokens, seq.num_computed + min(budget, seq.max_chunk or budget))
        return Chunk(seq, seq.num_computed, end)

    def _grow_decodes(self) -> list[SeqState]:
        """Give every running sequence blocks for all its positions, preempting if needed."""
        preempted: list[SeqState] = []
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted for an older one below
            assert seq.table is not None
            while not self.blocks.may_append(seq.table, seq.num_tokens):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq in self.running:
                self.blocks.append(seq.table, seq.num_tokens)
        for seq in self.running:  # then room for drafts, from free blocks only
            if seq.draft:
                assert seq.table is not None
                room = len(seq.table.block_ids) * self.blocks.block_size - seq.num_tokens
                while room < len(seq.draft) and self.blocks.num_free_blocks:
                    self.blocks.append(seq.table, seq.num_tokens + room + 1)
                    room = len(seq.table.block_ids) * self.blocks.block_size - seq.num_tokens
                del seq.draft[room:]
        return preempted

    def _preempt(self, seq: SeqState) -> None:
        self.running.remove(seq)
        assert seq.table is not None
        self.blocks.free(seq.table, seq.token_ids, seq.num_computed)
        seq.table = None
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.draft = []
        self.waiting.appendleft(seq)

    def _drop_cancelled(self) -> list[SeqState]:
        dropped = [s for s in (*self.running, *self.waiting) if s.cancelled]
        for seq in dropped:
            self.finish(seq)
        return dropped
