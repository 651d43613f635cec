"""Host store, slot pool and expert cache: exact slot size, fills, checksums and counting."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.engine.cache.expert_cache import ExpertCache, layer_counts
from services.engine.cache.formats import DenseFormat
from services.engine.cache.host_store import HostStore
from services.engine.cache.layout import ExpertLayout, swiglu
from services.engine.cache.policy import PolicySpec, Residency, StaticResidency
from services.engine.cache.slot_pool import SlotPool
from services.engine.model.checkpoint import CheckpointReader

D, F = 64, 32  # the tiny_dir checkpoint: hidden 64, expert FFN 32, 3 layers x 8 experts


@pytest.fixture(scope="module")
def host(tiny_dir) -> HostStore:
    store = HostStore(
        DenseFormat(D, F, torch.float32), [(layer, e) for layer in range(3) for e in range(8)]
    )
    store.load(CheckpointReader(tiny_dir))
    return store


def test_slot_bytes_is_one_exact_blob(host):
    assert host.slot_bytes == 3 * D * F * 4
    assert host.blobs.shape == (24, 3 * D * F) and host.blobs.is_contiguous()
    assert host.total_bytes == 24 * host.slot_bytes
    assert ExpertLayout(D, F).blob_bytes(torch.bfloat16) == 3 * D * F * 2


def test_layout_round_trips_hf_weights(tiny_dir, host):
    gate, up, down = CheckpointReader(tiny_dir).expert_weights(2, 5, D, F)
    gate_up_t, down_t = host.format.views(host.blob((2, 5)))
    assert torch.equal(gate_up_t[:, :F], gate.t()) and torch.equal(gate_up_t[:, F:], up.t())
    assert torch.equal(down_t, down.t())
    x = torch.randn(5, D)
    want = (torch.nn.functional.silu(x @ gate.t()) * (x @ up.t())) @ down.t()
    torch.testing.assert_close(host.format.forward(x, host.blob((2, 5))), want)
    assert torch.equal(host.format.forward(x, host.blob((2, 5))), swiglu(x, gate_up_t, down_t))


def test_fill_report_and_checksum(host):
    pool = SlotPool(5, host, torch.device("cpu"))
    ranked = [(1, 3), (0, 0), (1, 3), (2, 7), (0, 1), (0, 2), (0, 3), (0, 4)]
    report = pool.fill(ranked, source="profile")
    assert (report.filled, report.total_slots, report.verified) == (5, 5, True)
    assert report.elapsed_s >= 0 and report.mb_per_s > 0
    assert pool.policy.resident_pairs == [(1, 3), (0, 0), (2, 7), (0, 1), (0, 2)]
    assert torch.equal(pool.lookup((2, 7)), host.blob((2, 7)))
    assert pool.lookup((0, 3)) is None
    assert report.log_line().startswith("pre-filled 5 of 5 slots from the profile in ")
    assert report.log_line().endswith("MB/s); slot 0 verified")


def test_checksum_catches_a_corrupt_slot(host, monkeypatch):
    pool = SlotPool(2, host, torch.device("cpu"))
    real_copy = torch.Tensor.copy_

    def corrupting_copy(self, src, non_blocking=False):
        real_copy(self, src, non_blocking=non_blocking)
        self[0] += 1.0
        return self

    monkeypatch.setattr(torch.Tensor, "copy_", corrupting_copy)
    report = pool.fill([(0, 0), (0, 1)])
    monkeypatch.undo()
    assert report.filled == 2 and not report.verified
    assert "MISMATCH" in report.log_line()


def test_more_slots_than_ranked_pairs_and_empty_pool(host):
    pool = SlotPool(10, host, torch.device("cpu"))
    assert pool.fill([(0, 1), (0, 2), (99, 0)]).filled == 2  # unknown pairs are skipped
    empty = SlotPool(0, host, torch.device("cpu")).fill([(0, 0)])
    assert (empty.filled, empty.verified) == (0, True)


def test_lookups_counted_per_routed_token(host):
    pool = SlotPool(2, host, torch.device("cpu"))
    pool.fill([(0, 0), (1, 1)])
    cache = ExpertCache(host, pool, num_layers=3, num_experts=8)
    x = torch.randn(4, D)
    cache.begin_step(4, prefill=False)
    # 4 tokens: expert 0 (resident) for all of them, expert 1 (not resident) for 3
    top_idx = torch.tensor([[0, 1], [0, 1], [0, 1], [0, 2]])
    cache.route(0, top_idx, [4, 3, 1, 0, 0, 0, 0, 0])
    top_w = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])  # hit rows | miss
    y = cache.apply(0, x, top_idx, top_w)
    hit, miss = y[:3], y[3:]
    assert cache.step_token_hits.tolist() == [1, 1, 1, 1]
    assert (cache.lookups, cache.hits, cache.spilled) == (8, 4, 4)
    assert cache.decode.misses_host == 4 and cache.prefill.lookups == 0
    torch.testing.assert_close(hit, host.format.forward(x[:3], host.blob((0, 0))))
    torch.testing.assert_close(miss, host.format.forward(x[3:], host.blob((0, 2))))
    counts = cache.take_routing_counts()
    assert counts.dtype.name == "int64" and counts.shape == (3, 8)
    assert counts[0, 0] == 4 and counts[0, 1] == 3 and counts[0, 2] == 1 and counts.sum() == 8
    assert cache.take_routing_counts().sum() == 0


def test_decode_routing_counts_leave_out_prompt_tokens(host):
    pool = SlotPool(2, host, torch.device("cpu"))
    cache = ExpertCache(host, pool, num_layers=3, num_experts=8)
    cache.begin_step(3, prefill=np.array([True, True, False]))  # two prompt rows, one decode
    cache.route(1, torch.tensor([[0, 1], [0, 2], [0, 3]]), [3, 1, 1, 1, 0, 0, 0, 0])
    counts, decode = cache.take_phase_routing_counts()
    assert counts[1].tolist() == [3, 1, 1, 1, 0, 0, 0, 0]
    assert decode[1].tolist() == [1, 0, 0, 1, 0, 0, 0, 0] and decode.sum() == cache.decode.lookups
    assert cache.take_routing_counts().sum() == 0 and cache.decode_routing_counts.sum() == 0


def test_a_cache_holding_every_pair_counts_its_hits_in_bulk(host):
    """Every pair resident: a step's lookups (route() a layer at a time, or a table step's
    finish_table_step) are counted as a cache that must look each one up counts them, and
    the policy's order is left alone (nothing can be evicted)."""
    pairs = [(layer, e) for layer in range(3) for e in range(8)]
    rng = np.random.default_rng(3)
    caches = []
    for held in (pairs, pairs[:-1]):  # the second looks up one by one: (2, 7) is never routed
        pool = SlotPool(len(pairs), host, torch.device("cpu"),
                        Residency(len(pairs), PolicySpec("crf", pinned_fraction=0.25)))
        pool.fill(held)
        caches.append(ExpertCache(host, pool, num_layers=3, num_experts=8))
    bulk, one_by_one = caches
    keys = dict(bulk.residency._order._key)
    for step in range(6):
        rows = np.arange(4) < 2 if step % 2 else np.zeros(4, dtype=bool)  # prompt rows or none
        top = rng.permuted(np.tile(np.arange(7), (3, 4, 1)), axis=2)[:, :, :2]  # [L, T, K]
        for cache in caches:
            cache.begin_step(4, prefill=rows)
            if step < 3:
                for layer in range(3):
                    cache.route(layer, top[layer], np.bincount(top[layer].ravel(), minlength=8))
            else:
                cache.finish_table_step([0, 1, 2], top, layer_counts(top, 8))
            assert cache.step_token_hits.tolist() == [6] * 4
    assert bulk.decode == one_by_one.decode and bulk.prefill == one_by_one.prefill
    assert bulk.decode.hits == bulk.decode.lookups > 0 and bulk.prefill.lookups > 0
    assert np.array_equal(bulk.routing_counts, one_by_one.routing_counts)
    assert np.array_equal(bulk.decode_routing_counts, one_by_one.decode_routing_counts)
    assert (bulk.distinct_pairs_routed, bulk.layer_steps) == (
        one_by_one.distinct_pairs_routed, one_by_one.layer_steps)
    assert bulk.residency.clock == one_by_one.residency.clock > 0
    assert bulk.residency._order._key == keys != one_by_one.residency._order._key


def test_static_residency_is_pure_and_deduplicates():
    policy = StaticResidency(3)
    plan = policy.plan_fill([(0, 1), (0, 1), (2, 2), (1, 0), (1, 1)])
    assert plan == [(0, (0, 1)), (1, (2, 2)), (2, (1, 0))]
    assert policy.lookup((1, 0)) == 2 and policy.lookup((1, 1)) is None
    assert policy.plan_fill([(1, 1)]) == [(0, (1, 1))] and policy.lookup((0, 1)) is None
