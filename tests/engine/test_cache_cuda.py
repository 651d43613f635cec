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
    return ModelRunner(model_dir, device="cuda", device_memory_bytes=slots * SLOT_BYTES,
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
            assert set(d.reasons) <= {"host:cheaper", "copy:cheaper"}
        else:  # a host matmul may differ in the last bits: copies only
            assert d.misses_host == 0 and d.misses_copied == d.spilled
            assert set(d.reasons) <= {"copy:exact"}
        assert tokens == want_tokens
        torch.testing.assert_close(logits.cpu(), want_logits, atol=1e-4, rtol=0)
        results.append(logits.cpu())
    # every miss computed on the device by the same kernel from the same bytes: bit-identical
    assert all(torch.equal(r, results[0]) for r in results)


def test_prefetch_fills_and_slots_hold_the_host_bytes(tiny_dir):
    runner = cuda_runner(tiny_dir, 8, policy=PolicySpec("lru", 0.0), prefetch=True)
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
    assert set(d.reasons) <= {"host:cheaper", "copy:cheaper"}
    got = replay(Trace.read(path).records, 6, runner.policy, prefetch=runner.cache.prefetch)
    assert (got.decode.lookups, got.decode.hits) == (d.lookups, d.hits)
