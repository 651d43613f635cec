"""Faults with real processes and servers: an engine killed mid-stream, Redis stopped, engines
appearing in and leaving the registry, a breaker opening, a gateway dying with leases held."""

import asyncio
import logging

import aiohttp
import grpc
import pytest

from services.common.registry import EngineLoad, EngineRegistration
from services.gateway.ledger import Limits, RedisLedger

from .conftest import MODEL, ScriptedEngine, start_engine
from .test_overload import BODY, _health, _post, _wait_for, _wait_ready


async def _status_soon(http, base, wanted, timeout_s=5.0):
    for _ in range(int(timeout_s / 0.05)):
        async with http.get(base + "/readyz") as resp:
            if resp.status == wanted:
                return await resp.json()
        await asyncio.sleep(0.05)
    raise AssertionError(f"/readyz never answered {wanted}")


async def test_engine_killed_mid_stream_then_back(make_gateway):
    servicer = ScriptedEngine(tokens=["tok"] * 100, token_delay_s=0.02)
    server, port = await start_engine(servicer)
    base = await make_gateway(engine_addrs=(f"127.0.0.1:{port}",))
    async with aiohttp.ClientSession() as http:
        await _wait_ready(http, base)
        async with http.post(base + "/v1/chat/completions", json={**BODY, "stream": True}) as r:
            assert r.status == 200
            await r.content.readuntil(b"\n\n")
            await r.content.readuntil(b"\n\n")  # a token: the stream is under way
            await server.stop(grace=None)  # the engine dies
            text = (await r.read()).decode()
        events = [e for e in text.split("\n\n") if e]
        assert events[-1].startswith('data: {"error":') and "[DONE]" not in text
        body = await _status_soon(http, base, 503)
        assert body["status"] == "no_engine"
        status, headers, payload = await _post(http, base)
        assert status == 503 and headers["x-strata-drop-reason"] == "no_engine"
        server, _ = await start_engine(servicer, port)  # back on the same address
        await _status_soon(http, base, 200)
        status, *_ = await _post(http, base)
        assert status == 200
    await server.stop(grace=None)


async def test_redis_stopped_serving_continues_on_local_limits(redis_server, make_gateway, engine,
                                                               caplog):
    caplog.set_level(logging.INFO, "strata.gateway.limits")
    servicer, _ = engine
    servicer.token_delay_s = 0.05
    base = await make_gateway(max_inflight=1, max_queue=2, redis_url=redis_server.url)
    async with aiohttp.ClientSession() as http:
        assert (await _post(http, base))[0] == 200
        assert (await _health(http, base))["limits"] == "redis"
        redis_server.stop()
        results = await asyncio.gather(*(_post(http, base) for _ in range(10)))
        assert sorted(r[0] for r in results) == [200] * 3 + [429] * 7  # local caps, exact
        assert (await _health(http, base))["limits"] == "local"
        redis_server.start()  # same port
        for _ in range(100):
            if (await _health(http, base))["limits"] == "redis":
                break
            await asyncio.sleep(0.05)
        assert (await _health(http, base))["limits"] == "redis"
        assert (await _post(http, base))[0] == 200
    fallbacks = [r for r in caplog.records if "falls back" in r.message]
    assert len(fallbacks) == 1  # one log line per outage, not one per request
    assert any("shared again" in r.message for r in caplog.records)


async def test_dead_gateway_leases_expire(redis_server):
    limits = Limits(max_inflight=1, max_queue=0, max_queued_tokens=100)
    dead = RedisLedger(redis_server.url, limits, lease_ttl_s=0.3)
    alive = RedisLedger(redis_server.url, limits, lease_ttl_s=0.3)
    assert (await dead.enter("dead:1", ["e0"], 1)).engine == "e0"
    assert (await alive.enter("alive:1", ["e0"], 1)).rejected  # the cap holds across gateways
    await asyncio.sleep(0.4)  # the dead gateway never renews or releases
    assert (await alive.enter("alive:2", ["e0"], 1)).engine == "e0"
    await dead.close()
    await alive.close()


async def test_released_leases_leave_nothing_in_redis(redis_server):
    limits = Limits(max_inflight=1, max_queue=1, max_queued_tokens=100)
    a = RedisLedger(redis_server.url, limits, lease_ttl_s=30)
    b = RedisLedger(redis_server.url, limits, lease_ttl_s=30)
    assert (await a.enter("a:1", ["e0"], 1)).engine == "e0"
    assert (await b.enter("b:1", ["e0"], 7)).queued
    assert (await b.enter("b:2", ["e0"], 1)).rejected  # slot and queue taken
    await b.release("b:1", None)  # left the queue
    await a.release("a:1", "e0")  # finished
    r = a.redis
    assert (await r.zcard(a.inflight_key("e0")), await r.zcard(a._queue_keys[0]),
            await r.hlen(a._queue_keys[1])) == (0, 0, 0)
    assert (await b.enter("b:3", ["e0"], 1)).engine == "e0"  # the slot is free again
    await a.close()
    await b.close()


async def test_engines_found_in_the_registry(redis_server, make_gateway):
    servicer = ScriptedEngine()
    server, port = await start_engine(servicer)
    base = await make_gateway(engine_addrs=(), redis_url=redis_server.url)
    async with aiohttp.ClientSession() as http:
        assert (await _post(http, base))[0] == 503  # nothing registered yet
        registration = EngineRegistration(
            redis_server.url, engine_id="engine-0", address=f"127.0.0.1:{port}", model=MODEL,
            load=lambda: EngineLoad(servicer.running, 0, True), ttl_s=2.0, interval_s=0.1)
        await registration.start()
        body = await _status_soon(http, base, 200)
        assert [e["source"] for e in body["engines"]] == ["registry"]
        assert (await _post(http, base))[0] == 200
        await registration.stop()
        await _status_soon(http, base, 503)
        assert (await _health(http, base))["engines"] == []
    await server.stop(grace=None)


async def test_breaker_opens_after_repeated_faults_and_closes(make_gateway, engine):
    servicer, _ = engine
    base = await make_gateway(breaker_threshold=3, breaker_cooldown_s=0.5)
    async with aiohttp.ClientSession() as http:
        await _wait_ready(http, base)
        servicer.status_code = grpc.StatusCode.INTERNAL
        for _ in range(3):
            assert (await _post(http, base))[0] == 500
        body = await _status_soon(http, base, 503)
        assert body["engines"][0]["breaker"] in ("open", "half_open")
        status, headers, *_ = await _post(http, base)
        assert status == 503 and headers["x-strata-drop-reason"] == "no_engine"
        servicer.status_code = None
        await _status_soon(http, base, 200)  # after the cooldown a probe succeeds
        assert (await _post(http, base))[0] == 200
        assert (await _health(http, base))["engines"][0]["breaker"] == "closed"


@pytest.mark.parametrize("stream", [False, True])
async def test_deep_health_generates_one_token_and_caches(make_gateway, engine, stream):
    servicer, _ = engine
    base = await make_gateway(health_cache_s=60.0)
    async with aiohttp.ClientSession() as http:
        await _wait_ready(http, base)
        for _ in range(3):
            async with http.get(base + "/health") as resp:
                assert resp.status == 200
                body = await resp.json()
        assert body["generation"]["ok"] and body["generation"]["finish_reason"] == "length"
        health_calls = [r for r in servicer.requests if r.request_id.startswith("health-")]
        assert len(health_calls) == 1 and health_calls[0].sampling.max_tokens == 1
        async with http.get(base + "/livez") as resp:
            assert resp.status == 200


async def test_a_slow_status_probe_keeps_the_engine_a_hung_one_is_routed_around(make_gateway,
                                                                                engine):
    """GetStatus answered later than the probe timeout (a loaded host) does not take the only
    engine out of rotation by itself: a gateway that tolerates many failed probes keeps serving
    through a second of them. With `breaker_threshold` 3 the breaker opens after three probes in
    a row: 503 no_engine, until the engine answers in time again."""
    servicer, _ = engine
    fast = dict(engine_timeout_s=0.2, health_interval_s=0.1, breaker_cooldown_s=0.3)
    tolerant = await make_gateway(breaker_threshold=1000, **fast)
    strict = await make_gateway(breaker_threshold=3, **fast)
    async with aiohttp.ClientSession() as http:
        await _wait_ready(http, tolerant)
        await _wait_ready(http, strict)
        servicer.status_delay_s = 0.3  # every probe times out
        probed = servicer.num_status_calls
        await _wait_for(lambda: servicer.num_status_calls >= probed + 10, timeout_s=10)  # 5 each
        assert (await _post(http, tolerant))[0] == 200
        body = await _status_soon(http, strict, 503)
        assert body["engines"][0]["breaker"] in ("open", "half_open")
        status, headers, *_ = await _post(http, strict)
        assert status == 503 and headers["x-strata-drop-reason"] == "no_engine"
        servicer.status_delay_s = 0.0
        await _status_soon(http, strict, 200)
        assert (await _post(http, strict))[0] == 200


async def test_an_engine_back_from_the_dead_is_ready_at_the_next_probe_breaker_or_not(
        make_gateway):
    """A restarted engine (its breaker opened while it was gone) is ready as soon as a probe
    reaches it, not after the breaker's cooldown (a minute here, as doubled trials of a large
    model still loading would make it)."""
    servicer = ScriptedEngine(tokens=["tok"])
    server, port = await start_engine(servicer)
    base = await make_gateway(engine_addrs=(f"127.0.0.1:{port}",), breaker_threshold=1,
                              breaker_cooldown_s=60, health_interval_s=0.1)
    async with aiohttp.ClientSession() as http:
        await _wait_ready(http, base)
        await server.stop(grace=None)
        body = await _status_soon(http, base, 503)
        for _ in range(100):
            if body["engines"][0]["breaker"] == "open":
                break
            await asyncio.sleep(0.05)
            async with http.get(base + "/readyz") as resp:
                body = await resp.json()
        assert body["engines"][0]["breaker"] == "open", body
        server, _ = await start_engine(servicer, port)
        body = await _status_soon(http, base, 200)
        assert body["engines"][0]["breaker"] == "closed"
        status, *_ = await _post(http, base)
        assert status == 200
    await server.stop(grace=None)
