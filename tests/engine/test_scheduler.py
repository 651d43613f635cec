"""Scheduler and KV block manager, from factories, without a model."""

from __future__ import annotations

import itertools

import pytest

from services.engine.block_manager import BlockManager, NoFreeBlocks
from services.engine.scheduler import Scheduler, SeqState

_ids = itertools.count()


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(num_blocks=64, block_size=4, max_running=4, max_step_tokens=16, reuse=True):
    return Scheduler(BlockManager(num_blocks, block_size, reuse), max_running, max_step_tokens,
                     clock=Clock())


def seq(prompt_len: int, first_token: int = 1) -> SeqState:
    tokens = list(range(first_token, first_token + prompt_len))
    return SeqState(next(_ids), tokens, prompt_len)


def run_step(sched: Scheduler, new_token: int = 999):
    """One engine step: schedule, 'compute', append a sampled token where a chunk samples."""
    step = sched.schedule()
    sched.complete(step)
    for chunk in step.chunks:
        if chunk.samples:
            chunk.seq.token_ids.append(new_token)
    return step


def test_admission_is_fifo_and_bounded_by_max_running():
    sched = make_scheduler(max_running=2)
    a, b, c = seq(3), seq(3), seq(3)
    for s in (a, b, c):
        sched.add(s)
    step = run_step(sched)
    assert [ch.seq for ch in step.chunks] == [a, b] and list(sched.waiting) == [c]
    sched.clock.now = 5.0
    sched.finish(a)
    step = run_step(sched)
    assert {ch.seq for ch in step.chunks} == {b, c}
    assert c.wait_s == 5.0 and a.wait_s == 0.0


def test_long_prompt_is_chunked_and_decodes_keep_running():
    sched = make_scheduler(max_step_tokens=8)
    short = seq(3)
    sched.add(short)
    run_step(sched)  # short's prefill; it samples its first token
    long = seq(20, first_token=100)
    sched.add(long)
    spans = []
    for _ in range(4):
        step = run_step(sched)
        assert any(ch.seq is short and ch.end - ch.start == 1 for ch in step.chunks), \
            "the running decode must get a token every step"
        spans += [(ch.start, ch.end) for ch in step.chunks if ch.seq is long]
        assert step.num_tokens <= 8
    # 8-token budget minus short's decode token; then long decodes one token per step too.
    assert spans == [(0, 7), (7, 14), (14, 20), (20, 21)]


def test_a_sequence_may_bound_its_prefill_chunks_below_the_step_budget():
    """Prompt scoring (every position's logits) keeps each chunk's rows bounded."""
    sched = make_scheduler(max_step_tokens=16)
    scored = seq(25)
    scored.max_chunk = 10
    sched.add(scored)
    spans = [(ch.start, ch.end) for _ in range(3) for ch in run_step(sched).chunks]
    assert spans == [(0, 10), (10, 20), (20, 25)]


def test_waiting_for_blocks_then_preemption_when_a_decode_grows():
    # 6 blocks of 4 positions: two sequences of 11 tokens take 3 blocks each.
    sched = make_scheduler(num_blocks=6, block_size=4, max_step_tokens=32)
    a, b, c = seq(11), seq(11, first_token=50), seq(3, first_token=80)
    for s in (a, b, c):
        sched.add(s)
    run_step(sched)
    assert sched.running == [a, b] and list(sched.waiting) == [c], "c waits for blocks"
    step = run_step(sched)  # a and b each hold 12 tokens now: all 3 blocks full
    assert not step.preempted
    step = run_step(sched)  # a needs a 4th block: b (newest) is preempted
    assert step.preempted == (b,) and sched.running == [a]
    assert list(sched.waiting)[0] is b and b.table is None and b.num_preemptions == 1
    assert sched.blocks.num_free_blocks == 6 - 4


def test_cancellation_frees_blocks_within_one_step():
    sched = make_scheduler(num_blocks=8)
    a, b = seq(9), seq(5, first_token=40)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    assert sched.blocks.num_free_blocks == 8 - 3 - 2
    a.cancelled = True
    step = run_step(sched)
    assert step.dropped == (a,) and a not in sched.running
    assert all(ch.seq is not a for ch in step.chunks)
    assert sched.blocks.num_free_blocks == 8 - 2


def test_prefix_reuse_takes_full_blocks_of_an_equal_prefix():
    sched = make_scheduler(num_blocks=16, block_size=4)
    first = seq(10)
    sched.add(first)
    run_step(sched)
    sched.finish(first)
    again = SeqState(next(_ids), list(range(1, 11)) + [77, 78], 12)
    sched.add(again)
    step = run_step(sched)
    assert again.num_reused == 10, ("two full blocks of the shared 10-token prefix, and 9, 10 "
                                    "from the first's freed, partly filled last block")
    assert step.chunks[0].start == 10
    other = SeqState(next(_ids), [5] + list(range(2, 11)), 10)
    sched.add(other)
    run_step(sched)
    assert other.num_reused == 0, "a prefix differing at token 0 reuses nothing"


def test_a_fully_cached_prompt_still_computes_its_last_token():
    blocks = BlockManager(8, 4)
    table = blocks.allocate(list(range(8)))
    blocks.mark_computed(table, list(range(8)), 8)
    blocks.free(table)
    again = blocks.allocate(list(range(8)))
    assert again.num_reused_tokens == 7, "4 in a shared block, 3 copied from the second"
    plain = BlockManager(8, 4, partial_reuse=False)
    table = plain.allocate(list(range(8)))
    plain.mark_computed(table, list(range(8)), 8)
    plain.free(table)
    assert plain.allocate(list(range(8))).num_reused_tokens == 4


def cached(blocks: BlockManager, tokens: list[int]) -> list[int]:
    """A finished sequence's blocks (all its positions computed, then freed)."""
    table = blocks.allocate(tokens)
    blocks.mark_computed(table, tokens, len(tokens))
    ids = list(table.block_ids)
    blocks.free(table)
    return ids


def test_a_prompt_takes_the_equal_start_of_a_cached_block_as_a_copy():
    blocks = BlockManager(16, 4)
    donor = cached(blocks, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    blocks.allocate([50] * 12)  # takes the LRU free blocks: the donor's last ones are not free
    table = blocks.allocate([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 55, 56])
    assert table.block_ids[:2] == donor[:2], "full blocks shared"
    assert table.num_reused_tokens == 10, "8 shared + 2 copied (9, 10)"
    assert table.copy_from == (donor[2], table.block_ids[2]) and table.block_ids[2] != donor[2]
    # the donor stays cached for the next prompt: copies never take a block from others
    again = blocks.allocate([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 77, 78])
    assert again.num_reused_tokens == 11 and again.copy_from == (donor[2], again.block_ids[2])


def test_a_cached_block_taken_fresh_is_its_own_copy():
    blocks = BlockManager(2, 4)
    donor = cached(blocks, [1, 2, 3, 4, 5, 6, 7, 8])
    table = blocks.allocate([1, 2, 3, 4, 5, 6, 9])  # the donor's second block is the only free one
    assert table.block_ids == donor and table.copy_from is None
    assert table.num_reused_tokens == 6
    blocks.mark_computed(table, [1, 2, 3, 4, 5, 6, 9, 10], 8)  # it now holds other tokens
    blocks.free(table)
    assert blocks.allocate([1, 2, 3, 4, 5, 6, 7, 1]).num_reused_tokens == 6, (
        "the overwritten block no longer offers 7")


def test_a_freed_sequences_partly_filled_last_block_offers_its_computed_tokens():
    blocks = BlockManager(8, 4)
    tokens = [1, 2, 3, 4, 5, 6]
    table = blocks.allocate(tokens)
    blocks.mark_computed(table, tokens, 6)
    last = table.block_ids[1]
    blocks.free(table, tokens, 6)  # block 1 holds the K/V of 5, 6
    again = blocks.allocate([1, 2, 3, 4, 5, 6, 7])
    assert again.num_reused_tokens == 6, "the next turn starts with all of this one"
    assert again.copy_from in (None, (last, again.block_ids[1]))
    blocks.free(again)
    plain = BlockManager(8, 4)
    table = plain.allocate(tokens)
    plain.mark_computed(table, tokens, 6)
    plain.free(table)  # without its tokens: only the full block is offered
    assert plain.allocate([1, 2, 3, 4, 5, 6, 7]).num_reused_tokens == 4


def test_scheduler_steps_carry_the_copies_of_admitted_prompts():
    sched = make_scheduler(num_blocks=16, block_size=4)
    first = seq(10)
    sched.add(first)
    for _ in range(3):  # prefill, then two decodes: positions 0-11 computed
        run_step(sched)
    sched.finish(first)
    again = SeqState(next(_ids), list(range(1, 11)) + [55, 56], 12)
    sched.add(again)
    step = run_step(sched)
    assert again.num_reused == 10 and step.chunks[0].start == 10
    assert step.copies == () or step.copies == ((step.copies[0][0], again.table.block_ids[2]),)


def test_cached_blocks_are_evicted_lru_when_memory_is_needed():
    blocks = BlockManager(4, 2)
    old = blocks.allocate([1, 2, 3, 4, 5])
    blocks.mark_computed(old, [1, 2, 3, 4, 5], 5)
    blocks.free(old)
    assert blocks.num_cached_blocks == 2 and blocks.num_free_blocks == 4
    blocks.allocate([9, 9, 9, 9, 9, 9, 9])  # needs all 4 blocks: the cached ones are recycled
    assert blocks.num_cached_blocks == 0
    with pytest.raises(NoFreeBlocks):
        blocks.allocate([1, 2])


def test_reuse_off_never_shares():
    blocks = BlockManager(8, 2, enable_prefix_reuse=False)
    t = blocks.allocate([1, 2, 3, 4, 5])
    blocks.mark_computed(t, [1, 2, 3, 4, 5], 5)
    assert blocks.allocate([1, 2, 3, 4, 5]).num_reused_tokens == 0
