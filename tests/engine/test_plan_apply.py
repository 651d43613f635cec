"""New plan versions applied a few slots per engine step: the residency logic alone, the expert
cache's bytes, and end to end with the real cache manager daemon and a real engine gRPC server
(drift -> one version -> applied while a request is in flight; the cache manager going away and
coming back)."""

from __future__ import annotations

import asyncio
import logging
import random
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import torch

from services.cachemgr import daemon as daemon_module
from services.cachemgr.config import CacheMgrConfig
from services.cachemgr.daemon import start_daemon
from services.common.pb.strata.v1 import (
    cachemgr_pb2,
    cachemgr_pb2_grpc,
    engine_pb2,
    engine_pb2_grpc,
)
from services.common.profile import Profile
from services.common.redis_server import free_port
from services.engine.cache.policy import PolicySpec, Residency
from services.engine.core import Engine
from services.engine.driver import SequenceDriver
from services.engine.plan_watch import PlanApplier, PlanWatcher
from services.engine.planning import CacheManagerLink
from services.engine.runner import ModelRunner
from services.engine.server import StatusSource, set_serving, start_server

PAIRS = [(layer, e) for layer in range(4) for e in range(8)]


def apply_all(residency: Residency, max_swaps: int, between=lambda: None) -> list[list]:
    steps = []
    while True:
        fills, done = residency.plan_step(max_swaps)
        assert len(fills) <= max_swaps
        steps.append(fills)
        if done:
            return steps
        between()


def assert_consistent(r: Residency) -> None:
    slots = [r.lookup(p) for p in r.resident_pairs]
    assert len(set(slots)) == len(slots) and all(0 <= s < r.num_slots for s in slots)


@pytest.mark.parametrize("policy", ["crf", "lru", "static"])
def test_plan_steps_reach_what_a_full_fill_would_set_up(policy):
    spec = PolicySpec(policy, pinned_fraction=0.25)
    old, new = PAIRS[:12], PAIRS[:2] + PAIRS[7:9] + PAIRS[20:28]  # some pairs stay
    r = Residency(12, spec)
    r.plan_fill(old)
    slot_before = {p: r.lookup(p) for p in old}
    r.begin_plan(new + PAIRS)  # a whole ranking: only its first 12 distinct pairs count
    steps = apply_all(r, max_swaps=3)
    expected = Residency(12, spec)
    expected.plan_fill(new)
    assert set(r.resident_pairs) == set(expected.resident_pairs)
    for pair in expected.resident_pairs:  # the same pairs pinned (the core is slots 0..P-1)
        assert (r.lookup(pair) < r.num_pinned) == (expected.lookup(pair) < r.num_pinned)
    in_core = {p: expected.lookup(p) < r.num_pinned for p in new}
    staying = {p for p in set(new) & set(old) if (slot_before[p] < r.num_pinned) == in_core[p]}
    assert all(r.lookup(p) == slot_before[p] for p in staying)  # kept pairs never move
    moved = [pair for fills in steps for _, pair in fills]
    assert sorted(moved) == sorted(set(new) - staying)
    assert len(steps) >= len(moved) / 3
    assert_consistent(r)


def test_serving_between_plan_steps_keeps_the_residency_consistent():
    spec = PolicySpec("crf", pinned_fraction=0.25)
    rng = random.Random(0)
    r = Residency(12, spec)
    r.plan_fill(PAIRS)
    ranking = PAIRS[:]
    rng.shuffle(ranking)

    def serve_a_step():
        for layer in range(4):
            experts = rng.sample(range(8), 3)
            r.access(layer, [(e, rng.randint(1, 4)) for e in experts])
        assert_consistent(r)

    r.begin_plan(ranking)
    apply_all(r, max_swaps=2, between=serve_a_step)
    pinned = ranking[: r.num_pinned]
    assert all(r.lookup(p) is not None and r.lookup(p) < r.num_pinned for p in pinned)
    r.begin_plan(PAIRS)  # a plan_fill cancels a plan in progress
    r.plan_fill(PAIRS[::-1])
    assert r.plan_step(4) == ([], True)


def test_expert_cache_slots_hold_the_planned_pairs_bytes(tiny_dir):
    runner = ModelRunner(tiny_dir, cache_slots=12, reserved_bytes=0)
    runner.fill_cache(runner.layer_order_pairs())
    cache = runner.cache
    copies_before = cache.link.totals()[0]
    ranking = runner.layer_order_pairs()[::-1]
    cache.begin_plan(ranking)
    total = 0
    while True:
        filled, done = cache.apply_plan_step(4)
        assert filled <= 4
        total += filled
        if done:
            break
    copies, num_bytes, busy_s = cache.link.totals()
    assert copies - copies_before == total > 0 and busy_s > 0
    for pair in cache.residency.resident_pairs:
        assert torch.equal(cache.pool.slots[cache.residency.lookup(pair)], cache.host.blob(pair))
    assert set(ranking[: runner.slots]) <= set(cache.residency.resident_pairs)


# --- end to end: the real daemon and a real engine server --------------------------------------


def daemon_config(port: int, tmp_path, **overrides) -> CacheMgrConfig:
    return CacheMgrConfig.from_values({
        "host": "127.0.0.1", "port": port, "metrics_port": 0, "replan_settle_s": 0.0,
        "reserve_bytes": 0,  # what the engine says (0 reads as "not said")
        "profile_path": tmp_path / "expert-profile.bin", "profile_save_interval_s": 0,
        **overrides})


@pytest.fixture
async def served(tiny_dir, tmp_path, monkeypatch):
    """A cache manager daemon and an engine server holding its first plan, watching for more."""
    monkeypatch.setenv("STRATA_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(daemon_module, "FLUSH_INTERVAL_S", 0.1)
    port = free_port()
    daemon = await start_daemon(daemon_config(port, tmp_path))
    runner = ModelRunner(tiny_dir, cache_slots=12, reserved_bytes=0)
    link = CacheManagerLink(f"127.0.0.1:{port}", "engine-a", runner)
    plan = await link.get_plan()
    runner.fill_cache(plan.pairs, source=plan.source)
    engine = Engine(runner)
    status = StatusSource(engine, "engine-a", runner.model_name, "cpu")
    status.plan_version, status.plan_source = plan.version, plan.source
    server, engine_port, health = await start_server(engine, status, "127.0.0.1", 0)
    engine.start()
    await set_serving(health, True)
    watcher = PlanWatcher(link.address, "engine-a", link.shape(),
                          PlanApplier(engine, runner.cache, status, swap_slots=2),
                          device_memory_bytes=link.device_memory_bytes, reserved_bytes=0,
                          slots=link.slots, known_version=plan.version, initial_backoff_s=0.05,
                          max_backoff_s=0.2)
    watcher.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{engine_port}")
    s = SimpleNamespace(daemon=daemon, port=port, tmp_path=tmp_path, engine=engine,
                        stub=engine_pb2_grpc.EngineStub(channel), status=status, link=link,
                        runner=runner)
    yield s
    await watcher.stop()
    await channel.close()
    await server.stop(grace=None)
    engine.stop()
    await link.close()
    await s.daemon.stop(grace_s=1)


def hot_report(link: CacheManagerLink, hot: list[tuple[int, int]]) -> cachemgr_pb2.RoutingReport:
    """Another engine of the same model whose traffic routes to `hot`."""
    shape = link.shape()
    counts = np.zeros((shape.num_layers, shape.num_experts), dtype=np.int64)  # [L, E]
    for rank, (layer, expert) in enumerate(hot):
        counts[layer, expert] = 1000 - rank
    return cachemgr_pb2.RoutingReport(engine_id="engine-b", model=shape,
                                      counts=counts.ravel().tolist(), slots=12,
                                      device_memory_bytes=link.device_memory_bytes,
                                      plan_version=1)


def greedy(max_tokens: int = 40) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(request_id="r", prompt="The expert cache",
                                      sampling=engine_pb2.SamplingParams(max_tokens=max_tokens))


def token_ids(events) -> list[int]:
    return [t for e in events if e.HasField("delta") for t in e.delta.token_ids]


async def wait_for(predicate, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("timed out")


HOT = [(layer, e) for layer in (2, 1) for e in range(8)][:12]


async def drift_to_v2(s: SimpleNamespace) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") as channel:
        await cachemgr_pb2_grpc.CacheManagerStub(channel).ReportRouting(hot_report(s.link, HOT))
    await wait_for(lambda: s.status.plan_version == 2)


async def test_drift_gives_one_version_applied_while_a_request_is_in_flight(served):
    s = served
    assert (s.status.plan_version, s.status.plan_source) == (1, "layer-order")
    baseline = token_ids([e async for e in s.stub.Generate(greedy())])
    call = s.stub.Generate(greedy())
    first = await call.read()  # Started (with the first tokens): the request is in the engine
    assert first.HasField("started")
    await drift_to_v2(s)
    rest = []
    while (event := await call.read()) is not grpc.aio.EOF:
        rest.append(event)
    assert token_ids([first, *rest]) == baseline  # greedy output unchanged by the swaps
    assert s.status.plan_source == "routing-counts"
    residency = s.runner.cache.residency
    pinned = [p for p in residency.resident_pairs if residency.lookup(p) < residency.num_pinned]
    assert set(pinned) == set(HOT[: residency.num_pinned])
    # The same traffic again: no drift, no further version (the cache manager's answer names
    # its latest), so the engine still holds v2.
    async with grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") as channel:
        ack = await cachemgr_pb2_grpc.CacheManagerStub(channel).ReportRouting(
            hot_report(s.link, HOT))
    assert ack.plan_version == 2
    engine_status = await s.stub.GetStatus(engine_pb2.GetStatusRequest())
    assert engine_status.cache.plan_version == s.status.plan_version == 2
    assert token_ids([e async for e in s.stub.Generate(greedy())]) == baseline


async def test_engine_keeps_serving_without_the_cache_manager_and_takes_its_plan_back(
        served, caplog):
    caplog.set_level(logging.INFO)
    s = served
    baseline = token_ids([e async for e in s.stub.Generate(greedy(12))])
    await drift_to_v2(s)
    await s.daemon.stop(grace_s=1)
    await wait_for(lambda: any("unreachable for plan versions" in r.getMessage()
                               for r in caplog.records))
    down = [r.getMessage() for r in caplog.records if "unreachable for plan" in r.getMessage()]
    assert len(down) == 1 and "keeping plan v2" in down[0]
    assert await s.link.report(s.engine.totals, 2) is None  # counts are kept for later
    assert any("reports failed" in r.getMessage() for r in caplog.records)
    assert token_ids([e async for e in s.stub.Generate(greedy(12))]) == baseline
    assert s.status.plan_version == 2

    # Back on the same port with another ranking (its profile file): the engine takes it.
    shape = s.link.shape()
    ranked = [(layer, e) for layer in (0, 2, 1) for e in range(8)]
    counts = np.zeros((shape.num_layers, shape.num_experts), dtype=np.int64)  # [L, E]
    for rank, (layer, expert) in enumerate(ranked):
        counts[layer, expert] = 100 - rank
    Profile.from_counts(counts, shape.fingerprint).write(s.tmp_path / "expert-profile.bin")
    s.daemon = await start_daemon(daemon_config(s.port, s.tmp_path))
    await wait_for(lambda: s.status.plan_source == "profile")
    assert s.status.plan_version == 1  # a restarted cache manager numbers versions anew
    assert any("is back" in r.getMessage() for r in caplog.records)
    pinned = ranked[: s.runner.cache.residency.num_pinned]
    assert all(s.runner.cache.residency.lookup(p) is not None for p in pinned)
    assert token_ids([e async for e in s.stub.Generate(greedy(12))]) == baseline


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_plan_swaps_on_the_copy_stream_between_decode_steps_are_exact(tiny_dir):
    """CUDA: plan fills ride the copy stream (timed for the link figures) between steps of a
    sequence being decoded; the greedy tokens match a run without any plan change."""
    runner = ModelRunner(tiny_dir, device="cuda", cache_slots=12,
                         reserved_bytes=0)
    drive = SequenceDriver(runner)

    def decode(swap: bool) -> list[int]:
        runner.fill_cache(runner.layer_order_pairs())
        seq = drive.start(list(b"The expert cache"))
        logits, out = drive.prefill(seq), []
        if swap:
            runner.cache.begin_plan(runner.layer_order_pairs()[::-1])
        for _ in range(12):
            out.append(int(logits.argmax()))
            if swap:
                runner.cache.apply_plan_step(2)
            logits = drive.decode(seq, out[-1])
        drive.release(seq)
        return out

    assert decode(swap=True) == decode(swap=False)
    torch.cuda.synchronize()
    copies, num_bytes, busy_s = runner.cache.link.totals()
    assert copies > 0 and num_bytes == copies * runner.slot_bytes and busy_s > 0
    for pair in runner.cache.residency.resident_pairs:
        slot = runner.cache.residency.lookup(pair)
        assert torch.equal(runner.cache.pool.slots[slot].cpu(), runner.cache.host.blob(pair))
