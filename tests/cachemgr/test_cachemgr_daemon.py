"""The real daemon: gRPC server on a loopback port, real Redis, real Prometheus endpoint."""

import asyncio
import contextlib
import logging
import urllib.request

import grpc
import numpy as np
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.cachemgr.config import CacheMgrConfig
from services.cachemgr.daemon import start_daemon
from services.common.pb.strata.v1 import cachemgr_pb2, cachemgr_pb2_grpc, counters_pb2
from services.common.telemetry import setup_metrics

MiB = 2**20
MODEL = cachemgr_pb2.ModelShape(fingerprint="a1b2c3d4e5f60718", name="tiny-moe", num_layers=4,
                                num_experts=8, experts_per_token=2, slot_bytes=MiB)


def config(redis_url=None, **overrides):
    return CacheMgrConfig.from_values({"host": "127.0.0.1", "port": 0, "metrics_port": 0,
                                       "redis_url": redis_url, "replan_settle_s": 0.0,
                                       **overrides})


def report(engine_id="engine-a", hot=None, lookups=0, hits=0, prefetched=0, prefetch_used=0,
           **figures):
    """A report whose decode counters have these lookups and hits (every miss run from host
    memory) and prefetch predictions."""
    counts = np.zeros((4, 8), dtype=np.int64)  # [L, E]
    for (layer, expert), count in (hot or {}).items():
        counts[layer, expert] = count
    decode = counters_pb2.CacheCounters(lookups=lookups, hits=hits, misses_host=lookups - hits,
                                        predicted=prefetched, predicted_routed=prefetch_used)
    fields = {"tokens_generated": 0, "slots": 6, "device_memory_bytes": 6 * MiB,
              "reserved_bytes": 0, "plan_version": 1} | figures
    return cachemgr_pb2.RoutingReport(engine_id=engine_id, model=MODEL, decode=decode,
                                      counts=counts.reshape(-1).tolist(), **fields)


def plan_request(device_memory_bytes=6 * MiB):
    return cachemgr_pb2.GetPlanRequest(engine_id="engine-a", model=MODEL,
                                       device_memory_bytes=device_memory_bytes,
                                       reserved_bytes=2 * MiB)


def pairs(plan):
    return [(p.layer, p.expert) for p in plan.pairs]


def scrape(port: int) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} with otel_scope_* labels dropped."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        series, value = line.rsplit(" ", 1)
        if "{" in series:
            name, labels = series[:-1].split("{", 1)
            kept = [kv for kv in labels.split(",") if not kv.startswith("otel_scope_")]
            series = f"{name}{{{','.join(kept)}}}" if kept else name
        samples[series] = float(value)
    return samples


@pytest.fixture
async def provider():
    provider = setup_metrics("strata-cachemgr-test", 0, "127.0.0.1")
    yield provider
    provider.shutdown()


async def test_plans_follow_reported_counts_and_metrics_show_them(redis_server, provider):
    daemon = await start_daemon(config(redis_server.url), meter_provider=provider)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
            stub = cachemgr_pb2_grpc.CacheManagerStub(channel)
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="strata.v1.CacheManager"))
            assert health.status == health_pb2.HealthCheckResponse.SERVING

            plan = await stub.GetPlan(plan_request())
            assert (plan.slots, plan.total_pairs, plan.source) == (4, 32, "layer-order")
            assert pairs(plan) == [(0, 0), (0, 1), (0, 2), (0, 3)]

            ack = await stub.ReportRouting(report(
                hot={(3, 7): 40, (2, 5): 30, (1, 1): 20, (0, 4): 10},
                lookups=1000, hits=865, tokens_generated=50))
            assert ack.plan_version == plan.version + 1
            plan = await stub.GetPlan(plan_request())
            assert plan.source == "routing-counts" and plan.version == ack.plan_version
            assert pairs(plan) == [(3, 7), (2, 5), (1, 1), (0, 4)]

            # A second report shifts the ranking; counts add up in Redis.
            ack = await stub.ReportRouting(report(hot={(0, 4): 100}, lookups=1000, hits=900))
            plan = await stub.GetPlan(plan_request())
            # Same set, new order: no new version, and a version always names the same pairs.
            assert plan.version == ack.plan_version
            assert pairs(plan) == [(3, 7), (2, 5), (1, 1), (0, 4)]
            client = redis.Redis.from_url(redis_server.url)
            assert client.hget("strata:routing:a1b2c3d4e5f60718", "0:4") == b"110"
            client.close()

            samples = await asyncio.to_thread(scrape, provider.prometheus_port)
    finally:
        await daemon.stop(grace_s=1)

    engine = '{engine_id="engine-a"}'
    assert samples["strata_cache_slots" + engine] == 4  # from the last GetPlan
    assert samples["strata_cache_total_pairs" + engine] == 32
    assert samples["strata_cache_coverage" + engine] == pytest.approx(4 / 32)
    assert samples["strata_cache_lookups_total" + engine] == 2000
    assert samples["strata_cache_hits_total" + engine] == 1765
    assert samples["strata_cache_spilled_total" + engine] == 135 + 100
    assert samples["strata_cache_hit_ratio" + engine] == pytest.approx(0.9)
    assert samples["strata_cache_spill_ratio" + engine] == pytest.approx(0.1)
    assert samples["strata_device_memory_budget_bytes" + engine] == 6 * MiB
    assert samples['strata_plan_version{model="a1b2c3d4e5f60718"}'] == plan.version
    assert samples['strata_device_memory_total_bytes{device="host"}'] > 0
    assert samples['strata_device_memory_free_bytes{device="host"}'] > 0


async def test_keeps_serving_while_redis_is_down_and_flushes_later(redis_server, provider,
                                                                   fast_loop, caplog):
    caplog.set_level(logging.INFO, logger="strata.cachemgr")
    daemon = await start_daemon(config(redis_server.url), meter_provider=provider)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
            stub = cachemgr_pb2_grpc.CacheManagerStub(channel)
            await stub.ReportRouting(report(hot={(1, 1): 5}))
            redis_server.stop()

            await stub.ReportRouting(report(hot={(2, 2): 7}), timeout=5)
            await stub.ReportRouting(report(hot={(2, 2): 1}), timeout=5)
            plan = await stub.GetPlan(plan_request(), timeout=5)
            assert pairs(plan)[:2] == [(2, 2), (1, 1)]  # buffered counts still rank
            down = [r for r in caplog.records if "unreachable" in r.getMessage()]
            assert len(down) == 1 and "STRATA_REDIS_URL" in down[0].getMessage()

            redis_server.start()  # same port, empty: only what was buffered arrives
            # bounded calls: this client blocks the event loop the daemon runs on
            client = redis.Redis.from_url(redis_server.url, socket_timeout=2,
                                          socket_connect_timeout=2)
            for _ in range(50):
                with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                    if client.hget("strata:routing:a1b2c3d4e5f60718", "2:2"):
                        break
                await asyncio.sleep(0.1)
            assert client.hgetall("strata:routing:a1b2c3d4e5f60718") == {b"2:2": b"8"}
            client.close()
            assert daemon.manager.store.healthy
            assert any("reachable again" in r.getMessage() for r in caplog.records)
            await stub.ReportRouting(report(hot={(3, 3): 2}), timeout=5)
    finally:
        await daemon.stop(grace_s=1)


async def test_bad_requests_get_invalid_argument(provider):
    daemon = await start_daemon(config(), meter_provider=provider)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
            stub = cachemgr_pb2_grpc.CacheManagerStub(channel)
            bad = report()
            del bad.counts[-1]
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.ReportRouting(bad)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "counts has 31 entries" in error.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.GetPlan(cachemgr_pb2.GetPlanRequest(model=cachemgr_pb2.ModelShape()))
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "fingerprint is empty" in error.value.details()
            # In-memory counts still plan.
            await stub.ReportRouting(report(hot={(3, 1): 1}))
            plan = await stub.GetPlan(plan_request())
            assert pairs(plan)[0] == (3, 1)
    finally:
        await daemon.stop(grace_s=1)


async def test_budget_falls_back_to_the_configured_device_memory(provider):
    daemon = await start_daemon(config(device_memory_bytes=10 * MiB, reserve_bytes=3 * MiB),
                                meter_provider=provider)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
            stub = cachemgr_pb2_grpc.CacheManagerStub(channel)
            plan = await stub.GetPlan(cachemgr_pb2.GetPlanRequest(engine_id="e", model=MODEL))
            assert plan.slots == 7
    finally:
        await daemon.stop(grace_s=1)


async def test_a_plan_has_the_engines_own_slot_count(provider):
    """An engine sends the slot count its budget rule gave (after its weights, KV and draft
    reserve, which the cache manager does not see): the plan has exactly that many pairs,
    whatever the budget alone would hold; 0 is a count too. Negative counts are refused."""
    daemon = await start_daemon(config(device_memory_bytes=10 * MiB, reserve_bytes=3 * MiB),
                                meter_provider=provider)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
            stub = cachemgr_pb2_grpc.CacheManagerStub(channel)
            for slots in (4, 0, 32):
                plan = await stub.GetPlan(cachemgr_pb2.GetPlanRequest(
                    engine_id="e", model=MODEL, device_memory_bytes=10 * MiB, slots=slots))
                assert plan.slots == len(plan.pairs) == slots
            plan = await stub.GetPlan(cachemgr_pb2.GetPlanRequest(
                engine_id="e", model=MODEL, slots=10**6))
            assert plan.slots == 32  # every pair
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetPlan(cachemgr_pb2.GetPlanRequest(engine_id="e", model=MODEL,
                                                               slots=-1))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "slots must be >= 0" in err.value.details()
    finally:
        await daemon.stop(grace_s=1)
