"""The engine registry against a real Redis server: heartbeats, TTL expiry, stop, outages."""

import asyncio
import logging

import pytest

from services.common.redis_server import EmbeddedRedis
from services.common.registry import (
    EngineInfo,
    EngineLoad,
    EngineRegistration,
    EngineRegistry,
    RegistryUnavailable,
)


@pytest.fixture
def redis_server():
    with EmbeddedRedis() as server:
        yield server


async def test_register_heartbeat_and_stop(redis_server):
    load = EngineLoad(running=0, waiting=0, ready=False)
    reg = EngineRegistration(redis_server.url, engine_id="e-1", address="10.0.0.5:50051",
                             model="tiny", load=lambda: load, ttl_s=2.0, interval_s=0.05)
    registry = EngineRegistry(redis_server.url)
    await reg.start()
    [info] = await registry.engines()
    assert (info.engine_id, info.address, info.model, info.ready) == ("e-1", "10.0.0.5:50051",
                                                                       "tiny", False)
    load = EngineLoad(running=3, waiting=2, ready=True)
    for _ in range(100):
        [info] = await registry.engines()
        if info.running == 3:
            break
        await asyncio.sleep(0.02)
    assert (info.running, info.waiting, info.ready) == (3, 2, True)
    await reg.stop()
    assert await registry.engines() == []  # deregistered at once
    await registry.close()


async def test_dead_engine_expires_by_ttl(redis_server):
    reg = EngineRegistration(redis_server.url, engine_id="e-dead", address="h:1", model="m",
                             load=EngineLoad, ttl_s=0.3, interval_s=0.1)
    registry = EngineRegistry(redis_server.url)
    assert await reg.heartbeat()  # one heartbeat, then the "engine" dies without stop()
    assert [e.engine_id for e in await registry.engines()] == ["e-dead"]
    await asyncio.sleep(0.45)
    assert await registry.engines() == []
    await registry.close()


async def test_outage_is_survived_and_recovers(redis_server, caplog):
    caplog.set_level(logging.INFO, "strata.registry")
    reg = EngineRegistration(redis_server.url, engine_id="e-2", address="h:2", model="m",
                             load=EngineLoad, ttl_s=5.0, interval_s=0.05, timeout_s=0.2)
    registry = EngineRegistry(redis_server.url, timeout_s=0.2)
    await reg.start()
    redis_server.stop()
    with pytest.raises(RegistryUnavailable):
        await registry.engines()
    for _ in range(200):  # several failed heartbeats: logged once
        if reg.num_failed_heartbeats >= 3:
            break
        await asyncio.sleep(0.02)
    assert reg.num_failed_heartbeats >= 3
    assert sum("heartbeat" in r.message and "failed" in r.message for r in caplog.records) == 1
    redis_server.start()  # same port, empty (in-memory) data
    for _ in range(100):
        if await _ids(registry) == ["e-2"]:
            break
        await asyncio.sleep(0.05)
    assert await _ids(registry) == ["e-2"]
    assert any("reachable again" in r.message for r in caplog.records)
    await reg.stop()
    await registry.close()


async def _ids(registry):
    try:
        return [e.engine_id for e in await registry.engines()]
    except RegistryUnavailable:
        return None


def test_info_round_trip():
    info = EngineInfo("e", "h:1", "m", 1, 2, True, 123.5)
    assert EngineInfo.from_json(info.to_json()) == info
