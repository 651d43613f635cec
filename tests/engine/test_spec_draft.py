"""Speculative decoding without a model: prompt lookup, the acceptance rule (exact for greedy,
distribution-preserving for sampling, checked with chi-square bounds), and the scheduler's KV
reservation and rollback for draft positions."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from services.engine.block_manager import BlockManager
from services.engine.sampling import Sampler, SamplingConfig
from services.engine.scheduler import Scheduler, SeqState
from services.engine.spec import make_draft_source
from services.engine.spec.base import DraftRequest
from services.engine.spec.ngram import NgramDraft, lookup
from services.engine.spec.verify import accept_tokens

# -- prompt lookup ---------------------------------------------------------------------------


def test_lookup_proposes_what_followed_the_tail_last_time():
    tokens = np.array([5, 6, 7, 8, 9, 1, 5, 6])
    assert lookup(tokens, 3) == [7, 8, 9]
    assert lookup(tokens, 10) == [7, 8, 9, 1, 5, 6]  # runs up to the end of the sequence
    assert lookup(np.array([1, 2, 3, 4]), 3) == []  # the tail never occurred before
    assert lookup(np.array([4]), 3) == []


def test_lookup_prefers_the_longest_ngram_then_the_most_recent_full_continuation():
    # "2 3" occurs twice; with n=2 the match after "1 2 3" wins over the single-token "3" one.
    tokens = np.array([1, 2, 3, 40, 41, 9, 3, 50, 51, 2, 3])
    assert lookup(tokens, 2) == [40, 41]
    # Two matches of "7": the most recent one is followed by only one token before the end
    # ("7 7"), the older one by a full draft.
    tokens = np.array([7, 1, 2, 3, 8, 7, 7])
    assert lookup(tokens, 3, max_ngram=1) == [1, 2, 3]


def test_ngram_source_honours_each_requests_limit():
    source = make_draft_source("ngram")
    assert isinstance(source, NgramDraft) and source.memory_bytes == 0
    tokens = [1, 2, 3, 4, 1, 2]
    out = source.propose([DraftRequest(0, tokens, 4, 2), DraftRequest(1, tokens, 4, 0)])
    assert out == [[3, 4], []]
    for method in ("mtp", "draft"):
        with pytest.raises(ValueError):
            make_draft_source(method)


# -- acceptance ------------------------------------------------------------------------------


def one_hot_logits(targets: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.zeros(len(targets), vocab)
    logits[torch.arange(len(targets)), torch.tensor(targets)] = 5.0
    return logits


def test_greedy_keeps_the_longest_matching_prefix_plus_one_token():
    greedy = Sampler(SamplingConfig())
    assert accept_tokens(greedy, one_hot_logits([3, 4, 5]), [3, 4]) == [3, 4, 5]  # all + bonus
    assert accept_tokens(greedy, one_hot_logits([3, 4, 5]), [3, 7]) == [3, 4]
    assert accept_tokens(greedy, one_hot_logits([3, 4, 5]), [6, 4]) == [3]


def chi2_bound(df: int, z: float = 3.72) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df); z = 3.72 is p = 1e-4."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_matches(counts: np.ndarray, probs: np.ndarray) -> None:
    """Pearson chi-square of observed counts against probs (cells with mass only)."""
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token with probability 0 was emitted"
    expected = n * probs[keep]
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    assert stat < chi2_bound(int(keep.sum()) - 1), (stat, counts, expected)


LOGITS = torch.tensor(
    [
        [2.0, 1.5, 1.0, 0.2, -1.0, 0.0],
        [0.3, 2.2, -0.5, 1.0, 1.2, 0.1],
        [1.0, 0.0, 1.0, 0.5, 2.0, -2.0],
    ]
)


@pytest.mark.parametrize(
    "cfg",
    [
        SamplingConfig(temperature=1.0, seed=1),
        SamplingConfig(temperature=0.7, top_k=4, seed=2),
        SamplingConfig(temperature=1.3, top_p=0.8, seed=3),
    ],
)
def test_rejection_sampling_keeps_every_positions_distribution(cfg):
    """Drafts treated as point masses: the first emitted token is distributed as row 0's
    distribution; given the first draft kept, the second as row 1's; given both, the third
    as row 2's. One draft is likely, one is outside the top-k / top-p support."""
    sampler = Sampler(cfg)
    probs = np.stack([sampler.probs(row).numpy() for row in LOGITS])  # [3, V]
    draft = [0, 5]
    counts = np.zeros((3, LOGITS.shape[1]), dtype=np.int64)
    for _ in range(6000):
        out = accept_tokens(sampler, LOGITS, draft)
        assert 1 <= len(out) <= 3 and out[:-1] == draft[: len(out) - 1]
        for i, token in enumerate(out):
            counts[i, token] += 1
    for i in range(3):
        if counts[i].sum() >= 200:
            assert_matches(counts[i], probs[i])
    assert counts[1].sum() > 1000  # the likely draft was often kept


def test_rejection_sampling_with_a_draft_distribution():
    """A stochastic draft (a draft model's q): d ~ q, kept with min(1, p/q), else a draw from
    max(p - q, 0): the emitted token is still distributed as p."""
    sampler = Sampler(SamplingConfig(temperature=1.0, seed=4))
    p = sampler.probs(LOGITS[0]).numpy()
    q = torch.softmax(torch.tensor([0.0, 2.0, 0.5, 1.0, -1.0, 0.3]), dim=-1)  # [V]
    gen = torch.Generator().manual_seed(5)
    counts = np.zeros(LOGITS.shape[1], dtype=np.int64)
    for _ in range(6000):
        d = int(torch.multinomial(q, 1, generator=gen))
        out = accept_tokens(sampler, LOGITS[:2], [d], draft_probs=q[None])
        counts[out[0]] += 1
    assert_matches(counts, p)


# -- the scheduler: KV for draft positions, rollback --------------------------------------------

_ids = itertools.count()


def decoding(sched: Scheduler, *prompts: list[int]) -> list[SeqState]:
    """Sequences past their prefill, each with one sampled token not yet computed."""
    seqs = [SeqState(next(_ids), list(p), len(p)) for p in prompts]
    for seq in seqs:
        sched.add(seq)
    step = sched.schedule()
    assert len(step.chunks) == len(seqs) and all(c.samples for c in step.chunks)
    sched.complete(step)
    for seq in seqs:
        seq.token_ids.append(100)
    return seqs


def test_draft_positions_get_blocks_and_rejected_ones_are_released():
    blocks = BlockManager(16, 4)
    sched = Scheduler(blocks, 4, 32)
    [seq] = decoding(sched, [1, 2, 3])  # tokens [1, 2, 3, 100]: one block
    assert len(seq.table.block_ids) == 1
    seq.draft = [5, 6, 7, 8, 9]
    step = sched.schedule()
    [chunk] = step.chunks
    assert (chunk.start, chunk.end, chunk.draft) == (3, 4, (5, 6, 7, 8, 9))
    assert step.num_tokens == 6 and len(seq.table.block_ids) == 3  # positions 0..8
    sched.complete(step)
    assert seq.num_computed == 4
    seq.token_ids += [5, 60]  # verification kept one draft, then sampled 60
    sched.accept_draft(seq, 1)
    assert seq.num_computed == 5 and seq.num_pending == 1 and seq.draft == []
    assert len(seq.table.block_ids) == 2  # the third block only held rejected positions
    assert blocks.num_free_blocks == 14
    # Prefix hashes cover computed, accepted tokens only: block 0 = [1, 2, 3, 100].
    assert seq.table.num_hashed_blocks == 1
    again = blocks.allocate([1, 2, 3, 100, 5, 6, 7, 8, 9])
    assert again.num_reused_tokens == 4  # not the block with the rejected draft's K/V
    blocks.free(again)


def test_a_draft_never_preempts_and_is_cut_to_free_blocks_and_budget():
    blocks = BlockManager(3, 4)
    sched = Scheduler(blocks, 4, 32)
    a, b = decoding(sched, [1, 2], [10, 11, 12, 13, 14, 15, 16])  # 3 + 8 tokens: 1 + 2 blocks
    assert blocks.num_free_blocks == 0
    a.draft, b.draft = [7, 7, 7], [8, 8]
    step = sched.schedule()
    assert not step.preempted and len(sched.running) == 2
    assert {c.seq.seq_id: c.draft for c in step.chunks} == {a.seq_id: (7,), b.seq_id: ()}
    # The step's token budget cuts drafts too: decode tokens first, drafts in running order.
    sched = Scheduler(BlockManager(16, 4), 2, 5)
    a, b = decoding(sched, [1, 2], [3, 4])
    a.draft, b.draft = [7, 7, 7, 7], [8, 8, 8]
    step = sched.schedule()
    assert {c.seq.seq_id: c.draft for c in step.chunks} == {a.seq_id: (7, 7, 7), b.seq_id: ()}
    assert step.num_tokens == 5
