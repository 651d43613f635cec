"""Routing traces and offline replay: file round trip, the Belady oracle on hand-made sequences,
and a trace recorded live replaying to exactly the live figures for every policy."""

from __future__ import annotations

import pytest

from services.engine.cache.policy import POLICIES, PolicySpec
from services.engine.cache.replay import belady, replay
from services.engine.cache.trace import (
    DECODE,
    FILL,
    PREDICT,
    PREFILL,
    Trace,
    TraceError,
    TraceWriter,
)
from services.engine.driver import SequenceDriver
from tests.engine.test_runner import PROMPT, runner_with_slots

META = {"num_layers": 2, "num_experts": 8, "fingerprint": "f" * 16}


def write(path, steps, fill=None):
    """steps: [(kind, layer, [experts])] with one token per expert."""
    w = TraceWriter(path, META)
    if fill is not None:
        w.fill_record(fill)
    for kind, layer, experts in steps:
        w.layer_record(kind, layer, experts, [1] * len(experts))
    w.close()
    return Trace.read(path)


def test_trace_round_trip_and_truncation(tmp_path):
    path = tmp_path / "t.trace"
    t = write(path, [(PREFILL, 0, [1, 2]), (PREDICT, 1, [3]), (DECODE, 1, [3, 4])],
              fill=[(1, 3), (0, 0)])
    assert t.meta == META and [r.kind for r in t.records] == [FILL, PREFILL, PREDICT, DECODE]
    assert t.first_fill() == [(1, 3), (0, 0)]
    assert t.records[3].pairs_and_counts() == [(3, 1), (4, 1)] and t.records[3].layer == 1
    assert t.routing_counts()[1].tolist() == [0, 0, 0, 1, 1, 0, 0, 0]
    assert t.routing_counts((PREFILL,)).sum() == 2
    data = path.read_bytes()
    assert len(Trace.from_bytes(data[:-3]).records) == 3  # a cut-off last record is dropped
    with pytest.raises(TraceError, match="magic"):
        Trace.from_bytes(b"NOTATRACE" + data[9:])
    with pytest.raises(TraceError, match="cannot read"):
        Trace.read(tmp_path / "missing.trace")


def test_belady_on_a_textbook_sequence(tmp_path):
    # 3 slots, one expert per step: 1 2 3 4 1 2 5 1 2 3 4 5 -> MIN has 5 hits (7 misses)
    seq = [1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5]
    t = write(tmp_path / "b.trace", [(DECODE, 0, [e]) for e in seq])
    got = belady(t.records, 3, fill=[])
    assert (got.decode.lookups, got.decode.hits) == (12, 5)
    lru = replay(t.records, 3, PolicySpec("lru", 0.0), prefetch=False, fill=[])
    assert lru.decode.hits == 2  # 1 2 3 4 1 2 5 1 2 3 4 5 under LRU
    assert belady(t.records, 0, fill=[]).decode.hits == 0
    assert belady(t.records, 5, fill=[]).decode.hits == 12 - 5


@pytest.mark.parametrize("policy", POLICIES)
def test_belady_bounds_every_policy(tmp_path, policy):
    import random

    rng = random.Random(1)
    steps = [(DECODE, layer, sorted(rng.sample(range(8), 2))) for _ in range(200)
             for layer in (0, 1)]
    t = write(tmp_path / "r.trace", steps)
    for slots in (2, 5, 9, 16):
        oracle = belady(t.records, slots, fill=[]).decode.hits
        got = replay(t.records, slots, PolicySpec(policy, 0.0), prefetch=False, fill=[])
        assert got.decode.hits <= oracle


@pytest.mark.parametrize("policy,pinned,prefetch", [
    ("static", 0.0, False), ("lru", 0.25, True), ("lfu", 0.25, False), ("crf", 0.25, True),
    ("crf", 0.0, False)])
def test_live_trace_replays_to_the_live_figures(tiny_dir, tmp_path, policy, pinned, prefetch):
    from services.engine.sampling import Sampler, SamplingConfig

    path = tmp_path / "live.trace"
    spec = PolicySpec(policy, pinned)
    runner = runner_with_slots(tiny_dir, 7, policy=spec, prefetch=prefetch, record_routing=path)
    runner.fill_cache(runner.layer_order_pairs()[::-1])
    drive = SequenceDriver(runner)
    for i, prompt in enumerate((PROMPT, "another prompt, rather different")):
        sampler = Sampler(SamplingConfig(temperature=0.8, seed=i))
        seq = drive.start(runner.tokenizer.encode(prompt))
        logits = drive.prefill(seq, max_tokens=16)
        while seq.num_computed < seq.num_tokens:
            logits = drive.prefill(seq, max_tokens=16)
        for _ in range(20):
            logits = drive.decode(seq, sampler.sample(logits))
        drive.release(seq)
    runner.close()
    trace = Trace.read(path)
    assert trace.meta["slots"] == 7 and trace.meta["policy"] == policy
    got = replay(trace.records, 7, spec, prefetch=prefetch)
    live_decode, live_prefill = runner.cache_totals()
    for live, replayed in ((live_decode, got.decode), (live_prefill, got.prefill)):
        assert (replayed.lookups, replayed.hits, replayed.fills, replayed.prefetch_fills) == (
            live.lookups, live.hits, live.fills, live.prefetch_fills)
        assert (replayed.predicted, replayed.predicted_routed) == (live.predicted,
                                                                   live.predicted_routed)
    assert got.evictions == runner.cache.residency.evictions
    assert 0 < live_decode.hits < live_decode.lookups
    assert live_decode.predicted > 0  # predictions are recorded even with prefetch off
    assert belady(trace.records, 7).decode.hits >= (live_decode.hits if not prefetch else 0)
