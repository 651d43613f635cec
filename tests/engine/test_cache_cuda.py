"""The CUDA path of the expert cache: pinned host store, copy stream + events, demand fills and
prefetch, exact placement, the Triton kernel reading slots, staging buffers and the host store
in place. Skipped without a CUDA device."""

from __future__ import annotations

import pytest
import torch

from services.engine.cache.policy import POLICIES, PolicySpec
from services.engine.cache.replay import replay
from services.engine.cache.trace import Trace
from services.engine.runner import ModelRunner
from tests.engine.test_runner import PROMPT, greedy, runner_with_slots

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
SLOT_BYTES = 3 * 64 * 32 * 4


def cuda_runner(model_dir, slots: int, **kwargs) -> ModelRunner:
    return ModelRunner(model_dir, device="cuda", cache_slots=slots,
                       reserved_bytes=0, **kwargs)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_with_prefetch_is_exact_on_cuda(tiny_dir, policy):
    _, want_tokens, want_logits = greedy(runner_with_slots(tiny_dir, 0), PROMPT)
    results = []
    for slots in (0, 6, 12, 24):
        runner = cuda_runner(tiny_dir, slots, policy=PolicySpec(policy, 0.25),
                             placement="exact", prefetch=True)
        assert runner.cache.host.blobs.is_pinned() and runner.cache.on_cuda
        assert runner.fill_cache(runner.layer_order_pairs()[::-1]).verified
        seq, tokens, logits = greedy(runner, PROMPT)
        d = seq.stats.decode
        if runner.cache.host_exact:  # the device kernel reads host blobs in place: both exact
            assert runner.cache.device_kernel
            assert d.misses_host + d.misses_copied == d.spilled
            assert set(d.reasons) <= {"host:cheaper", "copy:cheaper", "host:table"}
        else:  # a host matmul may differ in the last bits: copies only
            assert d.misses_host == 0 and d.misses_copied == d.spilled
            assert set(d.reasons) <= {"copy:exact"}
        assert tokens == want_tokens
        torch.testing.assert_close(logits.cpu(), want_logits, atol=1e-4, rtol=0)
        results.append(logits.cpu())
    # every miss computed on the device by the same kernel from the same bytes: bit-identical
    assert all(torch.equal(r, results[0]) for r in results)


def test_prefetch_fills_and_slots_hold_the_host_bytes(tiny_dir):
    runner = cuda_runner(tiny_dir, 8, policy=PolicySpec("lru", 0.0), prefetch=True,
                         cuda_graphs=False)  # prefetch runs in eager steps
    runner.fill_cache(runner.layer_order_pairs())
    greedy(runner, PROMPT, n=32)
    torch.cuda.synchronize()
    d = runner.cache.decode
    assert d.prefetch_fills > 0 and d.fills > 0 and d.predicted > 0
    residency = runner.cache.residency
    for pair in residency.resident_pairs:  # every dynamic fill landed, byte for byte
        slot = residency.lookup(pair)
        assert torch.equal(runner.cache.pool.slots[slot].cpu(), runner.cache.host.blob(pair))


def test_auto_placement_and_live_replay_on_cuda(tiny_dir, tmp_path):
    path = tmp_path / "cuda.trace"
    runner = cuda_runner(tiny_dir, 6, placement="auto", record_routing=path)
    runner.fill_cache(runner.layer_order_pairs())
    greedy(runner, PROMPT)
    runner.close()
    d = runner.cache.decode
    assert d.misses_host + d.misses_copied == d.spilled
    assert set(d.reasons) <= {"host:cheaper", "copy:cheaper", "host:table"}
    got = replay(Trace.read(path).records, 6, runner.policy, prefetch=runner.cache.prefetch)
    assert (got.decode.lookups, got.decode.hits) == (d.lookups, d.hits)


@pytest.mark.parametrize("policy", ["static", "crf"])
def test_graphed_decode_steps_equal_eager_ones(tiny_dir, policy):
    """Decode steps replayed from CUDA graphs give the eager steps' bits, lookups, hits and
    fills at every coverage, with the policy's fills going on between the steps."""
    for slots in (0, 6, 24):
        runs = {}
        for graphs in (False, True):
            runner = cuda_runner(tiny_dir, slots, policy=PolicySpec(policy, 0.25),
                                 prefetch=False, cuda_graphs=graphs)
            runner.fill_cache(runner.layer_order_pairs()[::-1])
            seq, tokens, logits = greedy(runner, PROMPT, n=24)
            assert (runner.graphs is not None) == graphs
            if graphs:  # captured at start, each batch size of the default list
                assert runner.graphs.replays == 24 and sorted(runner.graphs.graphs) == [*range(1, 9)]
                d = runner.cache.decode
                assert "host:table" in d.reasons or d.spilled == 0
            runs[graphs] = (tokens, logits.cpu(), runner.cache.decode, runner)
        (t0, l0, d0, _), (t1, l1, d1, graphed) = runs[False], runs[True]
        assert t1 == t0 and torch.equal(l1, l0)
        assert (d1.lookups, d1.hits, d1.fills) == (d0.lookups, d0.hits, d0.fills)
        torch.cuda.synchronize()
        cache = graphed.cache
        for (layer, expert), slot in cache._where.items():  # every table entry is right
            assert cache.residency.lookup((layer, expert)) == slot
            assert int(cache.addr_table[layer, expert]) == cache.pool.slots[slot].data_ptr()
            assert torch.equal(cache.pool.slots[slot].cpu(), cache.host.blob((layer, expert)))


def test_graphs_per_batch_size_match_eager_batched_steps(tiny_dir):
    """Batch sizes 1 and 3 captured at start replay; batch 2, not captured, runs eagerly;
    every step gives the eager steps' tokens."""
    from services.engine.driver import SequenceDriver

    prompts = [list(b"first prompt"), list(b"second"), list(b"the third one")]
    outs = {}
    for graphs in (False, True):
        runner = cuda_runner(tiny_dir, 12, cuda_graphs=graphs, graph_batches=(1, 3))
        runner.fill_cache(runner.layer_order_pairs())
        drive = SequenceDriver(runner)
        seqs = [drive.start(p) for p in prompts]
        tokens = [[int(drive.prefill(s).argmax())] for s in seqs]
        for step in range(8):
            live = seqs[: 1 + step % 3]  # batches of 1, 2, 3 sequences in turn
            logits = drive.decode_batch(live, [toks[-1] for toks in tokens[:len(live)]])
            for toks, row in zip(tokens, logits, strict=False):
                toks.append(int(row.argmax()))
        outs[graphs] = tokens
        if graphs:
            assert sorted(runner.graphs.graphs) == [1, 3]
            assert runner.graphs.replays == 5  # the steps of 1 and 3 sequences
    assert outs[True] == outs[False]


def test_graphed_decode_steps_do_not_prefetch(tiny_dir):
    runner = cuda_runner(tiny_dir, 6, policy=PolicySpec("crf", 0.25), prefetch=True)
    runner.fill_cache(runner.layer_order_pairs())
    _, tokens, _ = greedy(runner, PROMPT, n=8)
    d = runner.cache.decode
    assert runner.graphs.replays == 8
    assert d.predicted == 0 and d.prefetch_fills == 0
    eager = cuda_runner(tiny_dir, 6, policy=PolicySpec("crf", 0.25), prefetch=True,
                        cuda_graphs=False)
    eager.fill_cache(eager.layer_order_pairs())
    assert greedy(eager, PROMPT, n=8)[1] == tokens and eager.cache.decode.predicted > 0


def test_bf16_is_exact_across_cache_sizes_on_cuda(tiny_bf16_dir):
    """bf16 weights and activations on the device: the Triton kernel reads the same bf16 bytes
    from a slot or in place from the host store, so every cache size gives the same logits."""
    results = []
    for slots in (0, 6, 24):
        runner = ModelRunner(tiny_bf16_dir, device="cuda", cache_slots=slots, reserved_bytes=0,
                             placement="exact")
        assert runner.weight_dtype == runner.dtype == torch.bfloat16 and runner.slots == slots
        runner.fill_cache(runner.layer_order_pairs()[::-1])
        _, tokens, logits = greedy(runner, PROMPT, n=12)
        results.append((tokens, logits.cpu()))
    assert all(t == results[0][0] and torch.equal(lg, results[0][1]) for t, lg in results)
