"""Plan versions end to end: the real daemon (gRPC on loopback, real Redis, profile file on disk)
and the engine's PlanWatcher: counts from two engines add up, drift issues exactly one version,
the watcher keeps its plan while the daemon is down and picks up the restarted daemon's plan,
which comes from the profile saved at shutdown."""

import asyncio
import logging
import time

import grpc
import pytest
import redis
from test_cachemgr_daemon import MODEL, config, pairs, plan_request, report

from services.cachemgr.daemon import start_daemon
from services.common.pb.strata.v1 import cachemgr_pb2, cachemgr_pb2_grpc
from services.common.profile import Profile
from services.common.redis_server import free_port
from services.engine.plan_watch import PlanWatcher

HOT_A = {(3, 7): 40, (2, 5): 30, (1, 1): 20, (0, 4): 10}
HOT_B = {(0, 0): 400, (1, 2): 300, (2, 3): 200, (3, 5): 100}


async def next_plan(queue: asyncio.Queue, timeout_s: float = 5.0):
    return await asyncio.wait_for(queue.get(), timeout_s)


async def wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_watch_drift_restart_and_profile(redis_server, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    port = free_port()
    profile_path = tmp_path / "data" / "expert-profile.bin"
    settings = {"port": port, "profile_path": profile_path, "profile_save_interval_s": 0}
    daemon = await start_daemon(config(redis_server.url, **settings))
    plans: asyncio.Queue = asyncio.Queue()
    watcher = PlanWatcher(f"127.0.0.1:{port}", "engine-a", MODEL, plans.put_nowait,
                          device_memory_bytes=6 * 2**20, reserved_bytes=2 * 2**20,
                          initial_backoff_s=0.05, max_backoff_s=0.2)
    watcher.start()
    try:
        first = await next_plan(plans)
        assert (first.version, first.slots, first.source) == (1, 4, "layer-order")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = cachemgr_pb2_grpc.CacheManagerStub(channel)
            # Two engines report halves of the same hot set: their counts add up in Redis.
            half = {pair: count // 2 for pair, count in HOT_A.items()}
            await stub.ReportRouting(report("engine-a", hot=half, slots=4))
            await stub.ReportRouting(report("engine-b", hot=half, slots=4))
            client = redis.Redis.from_url(redis_server.url)
            assert client.hget("strata:routing:a1b2c3d4e5f60718", "3:7") == b"40"
            second = await next_plan(plans)
            assert second.version == 2 and second.source == "routing-counts"
            assert set(second.pairs) == set(HOT_A)
            # More of the same hot set: no drift, no version (each answer names the latest;
            # and the watcher's next plan below is the shift's, so none came in between).
            for engine in ("engine-a", "engine-b"):
                ack = await stub.ReportRouting(report(engine, hot=HOT_A, slots=4))
                assert ack.plan_version == 2
            # The workload shifts: exactly one new version, and none for the reports after it.
            acks = [(await stub.ReportRouting(report("engine-b", hot=HOT_B, slots=4))).plan_version
                    for _ in range(4)]
            assert acks == sorted(acks) and set(acks) == {2, 3} and acks[-2:] == [3, 3], acks
            third = await next_plan(plans)
            assert third.version == 3 and set(third.pairs) == set(HOT_B)
            overview = await stub.GetOverview(cachemgr_pb2.OverviewRequest())
            assert [(m.plan_version, m.source) for m in overview.models] == [
                (3, "routing-counts")]
    finally:
        await daemon.stop(grace_s=1)

    # Down: the watcher keeps v3 (the three versions were all it got) and says so once,
    # however many retries fail.
    saved = Profile.read(profile_path)
    assert saved.top_pairs(4) == [(0, 0), (1, 2), (2, 3), (3, 5)]
    attempts = watcher.num_attempts
    await wait_for(lambda: watcher.num_attempts >= attempts + 3)
    assert watcher.plan == third and watcher.num_plans == 3 and not watcher.connected
    down = [r for r in caplog.records if "unreachable for plan versions" in r.getMessage()]
    assert len(down) == 1 and "keeping plan v3" in down[0].getMessage()

    # Back (same port, same Redis): the profile saved at shutdown ranks the first plan.
    daemon = await start_daemon(config(redis_server.url, **settings))
    try:
        again = await next_plan(plans)
        assert again.version == 1 and again.source == "profile"
        assert again.pairs == third.pairs
        assert any("is back" in r.getMessage() for r in caplog.records)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = cachemgr_pb2_grpc.CacheManagerStub(channel)
            plan = await stub.GetPlan(plan_request())
            assert plan.version == 1 and pairs(plan) == list(third.pairs)
            # Redis's history is not counted twice on top of the loaded profile.
            await stub.ReportRouting(report("engine-a", hot={(0, 0): 5}, slots=4))
    finally:
        await watcher.stop()
        await daemon.stop(grace_s=1)
    counts = Profile.read(profile_path).counts()
    assert counts[0, 0] == pytest.approx(saved.counts()[0, 0] + 5, abs=1)
    assert counts[3, 7] == pytest.approx(saved.counts()[3, 7], abs=1)
