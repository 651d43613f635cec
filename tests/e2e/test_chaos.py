"""Faults for real: `strata up` clusters whose processes the tests kill (SIGKILL), hang (SIGSTOP)
and bring back, on loopback ports. Each test starts its own cluster and stops it; each bounds its
waits and writes its figures (time to readiness, counts of terminal outcomes) to the run's
"fault figures" summary."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter
from collections.abc import Callable

import aiohttp
import grpc
import pytest

from services.common.pb.strata.v1 import (
    cachemgr_pb2,
    cachemgr_pb2_grpc,
    engine_pb2,
    engine_pb2_grpc,
)
from services.models import DEFAULT_MODEL_NAME as MODEL
from tests.e2e.conftest import RunningCluster, start_cluster, stop_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

LONG = {"model": MODEL, "prompt": "def parse_args(argv):", "max_tokens": 400,
        "ignore_eos": True, "temperature": 0, "stream": True}
SHORT = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 4, "temperature": 0}


async def wait_for(what: str, check: Callable[[], object], timeout_s: float,
                   poll_s: float = 0.1) -> float:
    """Seconds until `check()` (sync or async) is truthy; fails after `timeout_s`."""
    t0 = time.monotonic()
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < timeout_s, f"{what}: not within {timeout_s:.0f} s"
        await asyncio.sleep(poll_s)


async def readyz(session: aiohttp.ClientSession, c: RunningCluster) -> tuple[int, dict]:
    async with session.get(f"http://127.0.0.1:{c.port}/readyz") as r:
        return r.status, await r.json()


async def stream(session: aiohttp.ClientSession, c: RunningCluster, body: dict,
                 started: asyncio.Event | None = None) -> dict:
    """One streamed completion to its end: the tokens seen, and every terminal event (error
    events, finish reasons, [DONE], a connection cut) counted, so that "exactly one" can be
    asserted."""
    tokens, ends, error = 0, Counter(), None
    async with session.post(f"{c.base_url}/completions", json=body) as r:
        if r.status != 200:
            return {"status": r.status, "tokens": 0, "ends": Counter(http_error=1),
                    "error": (await r.json())["error"]}
        async for raw in _lines(r):
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                ends["done"] += 1
                continue
            event = json.loads(data)
            if "cut" in event:
                ends["cut"] += 1
            elif "error" in event:
                ends["error"] += 1
                error = event["error"]
            elif event.get("choices"):
                tokens += 1
                if started is not None and tokens == 1:
                    started.set()
                if event["choices"][0].get("finish_reason"):
                    ends["finished"] += 1
    return {"status": 200, "tokens": tokens, "ends": ends, "error": error}


async def _lines(r: aiohttp.ClientResponse):
    try:
        async for raw in r.content:
            yield raw
    except aiohttp.ClientPayloadError:  # the server went away mid-response
        yield b"data: {\"cut\": true}"


async def complete(session: aiohttp.ClientSession, c: RunningCluster,
                   body: dict = SHORT) -> tuple[int, dict, dict]:
    async with session.post(f"{c.base_url}/completions", json=body) as r:
        return r.status, dict(r.headers), await r.json()


def engine_status(c: RunningCluster) -> engine_pb2.StatusResponse:
    with grpc.insecure_channel(f"127.0.0.1:{c.engine_port}") as channel:
        return engine_pb2_grpc.EngineStub(channel).GetStatus(engine_pb2.GetStatusRequest(),
                                                             timeout=5)


def overview(c: RunningCluster) -> cachemgr_pb2.Overview:
    with grpc.insecure_channel(f"127.0.0.1:{c.cachemgr_port}") as channel:
        return cachemgr_pb2_grpc.CacheManagerStub(channel).GetOverview(
            cachemgr_pb2.OverviewRequest(), timeout=5)


@pytest.fixture
def cluster8(tmp_path):
    c = start_cluster(tmp_path, "--max-inflight", "8", "--max-queue", "8")
    yield c
    assert stop_cluster(c) == 0, c.output.read_text()[-3000:]


async def test_sigkill_of_the_engine_ends_every_stream_once_and_it_comes_back(
        cluster8, figures):
    c = cluster8
    async with aiohttp.ClientSession() as session:
        starts = [asyncio.Event() for _ in range(8)]
        streams = [asyncio.create_task(stream(session, c, LONG, e)) for e in starts]
        await wait_for("8 streams producing tokens", lambda: all(e.is_set() for e in starts),
                       60)
        old_pid = c.pid("engine")
        os.kill(old_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        ends = await asyncio.wait_for(asyncio.gather(*streams), 60)
        outcomes = sum((e["ends"] for e in ends), Counter())
        figures(f"8 streams at the kill: terminal events {dict(outcomes)}, tokens each before "
                f"it {sorted(e['tokens'] for e in ends)}; {ends[0]['error']['message']!r}")
        assert outcomes == {"error": 8}, ends  # exactly one terminal event each, no [DONE]
        assert all(e["ends"] == {"error": 1} and e["error"]["type"] for e in ends)

        not_ready = await wait_for("/readyz 503", lambda: _status_is(session, c, 503), 30)
        status, body = await readyz(session, c)
        assert (body["inflight"], body["queued"]) == (0, 0), body  # nothing left admitted
        status, headers, refused = await complete(session, c)  # while the engine is away
        assert status == 503 and refused["error"]["code"] == "no_engine", refused
        assert int(headers["Retry-After"]) >= 1
        await wait_for("/readyz 200 after the restart", lambda: _status_is(session, c, 200), 30)
        figures(f"readiness: 503 {not_ready:.1f} s after the kill, 200 again "
                f"{time.monotonic() - killed_at:.1f} s after it")
        assert c.pid("engine") != old_pid

        served = await asyncio.gather(*(complete(session, c) for _ in range(4)))
        assert [s[0] for s in served] == [200] * 4, served
    status = await asyncio.to_thread(engine_status, c)
    assert status.requests_finished == 4  # the new process: only the requests after the kill
    assert status.cache.plan_version >= 1  # it asked the cache manager for its plan again
    await wait_for("the cache manager hears from the new engine", lambda: any(
        e.engine_id == status.engine_id and e.tokens_generated >= 16
        for e in overview(c).engines), 30)
    assert "engine was killed by SIGKILL" in c.output.read_text()


async def _status_is(session: aiohttp.ClientSession, c: RunningCluster, code: int) -> bool:
    try:
        return (await readyz(session, c))[0] == code
    except aiohttp.ClientError:
        return False


async def test_a_hung_engine_times_requests_out_opens_the_breaker_and_recovers(tmp_path,
                                                                               figures):
    c = start_cluster(tmp_path, "--max-inflight", "4", "--max-queue", "4",
                      env={"STRATA_REQUEST_TIMEOUT_S": "4"})
    pid = c.pid("engine")
    try:
        async with aiohttp.ClientSession() as session:
            assert (await complete(session, c))[0] == 200
            started = asyncio.Event()
            streaming = asyncio.create_task(stream(session, c, LONG, started))
            await wait_for("a stream producing tokens", started.is_set, 60)
            os.kill(pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            waiting = asyncio.create_task(complete(session, c))
            end = await asyncio.wait_for(streaming, 30)
            assert end["ends"] == {"error": 1} and end["error"]["type"] == "timeout_error", end
            status, _, body = await asyncio.wait_for(waiting, 30)
            assert status == 504 and body["error"]["type"] == "timeout_error", body
            opened = await wait_for("/readyz 503 (breaker open)",
                                    lambda: _status_is(session, c, 503), 30)
            _, state = await readyz(session, c)
            assert state["engines"][0]["breaker"] == "open", state
            figures(f"hung engine: {end['error']['message']!r}; breaker open "
                    f"{time.monotonic() - stopped_at:.1f} s after SIGSTOP ({opened:.1f} s "
                    "after the deadlines)")
            os.kill(pid, signal.SIGCONT)
            back = await wait_for("/readyz 200 after SIGCONT",
                                  lambda: _status_is(session, c, 200), 30)
            figures(f"hung engine: ready {back:.1f} s after SIGCONT")
            assert (await complete(session, c))[0] == 200
        assert c.pid("engine") == pid  # hung is not dead: nothing was restarted
    finally:
        os.kill(pid, signal.SIGCONT)
        assert stop_cluster(c) == 0, c.output.read_text()[-3000:]


async def test_sigkill_of_the_cache_manager_keeps_the_engine_on_its_plan(cluster8, figures):
    c = cluster8
    before = await asyncio.to_thread(engine_status, c)
    old_pid = c.pid("cachemgr")
    os.kill(old_pid, signal.SIGKILL)
    async with aiohttp.ClientSession() as session:
        served = await asyncio.gather(*(complete(session, c) for _ in range(4)))
        assert [s[0] for s in served] == [200] * 4, served
        back = await wait_for("the cache manager restarted", lambda: c.pid("cachemgr") != old_pid
                              and "cachemgr: ready again" in c.output.read_text(), 30)
        during = await asyncio.to_thread(engine_status, c)
        assert (during.cache.plan_version, during.cache.plan_source) == (
            before.cache.plan_version, before.cache.plan_source)
        assert during.cache.slots == before.cache.slots
        assert during.cache.coverage == before.cache.coverage

        reported = await wait_for("the engine's reports reach the new cache manager", lambda: any(
            e.engine_id == before.engine_id and e.tokens_generated > 0
            for e in overview(c).engines), 30)
        # the plan watch reconnects on its own backoff (0.5 s doubling while the manager was
        # down), so its line may follow the reports by a few seconds
        watching = await wait_for("the engine's plan watch is back",
                                  lambda: "is back" in c.engine_log(), 30)
        figures(f"cache manager back {back:.1f} s after SIGKILL; the engine's reports resumed "
                f"{reported:.1f} s later, its plan watch {watching:.1f} s after that")
        assert (await complete(session, c))[0] == 200


async def test_sigkill_of_redis_falls_back_to_local_limits_and_resumes(cluster8, figures):
    c = cluster8
    async with aiohttp.ClientSession() as session:
        assert (await readyz(session, c))[1]["limits"] == "redis"
        old_pid = c.pid("redis")
        os.kill(old_pid, signal.SIGKILL)
        served = await asyncio.gather(*(complete(session, c) for _ in range(4)))
        assert [s[0] for s in served] == [200] * 4, served
        back = await wait_for("Redis restarted", lambda: c.pid("redis") != old_pid, 30)
        shared = await wait_for("shared limits again",
                                lambda: _limits_are(session, c, "redis"), 30)
        figures(f"redis back {back:.1f} s after SIGKILL; the gateway's limits shared again "
                f"{shared:.1f} s later")
        assert (await complete(session, c))[0] == 200

    from services.common.registry import EngineRegistry

    registry = EngineRegistry(c.redis_url)
    try:
        await wait_for("the engine registered again", lambda: _registered(registry, c), 30)
    finally:
        await registry.close()
    gateway_log = (c.log_dir / "gateway.log").read_text()
    assert "admission falls back to this gateway's own limits" in gateway_log, gateway_log
    assert "admission limits are shared again" in gateway_log, gateway_log


async def _limits_are(session: aiohttp.ClientSession, c: RunningCluster, mode: str) -> bool:
    return (await readyz(session, c))[1]["limits"] == mode


async def _registered(registry, c: RunningCluster) -> bool:
    return [e.address for e in await registry.engines()] == [f"127.0.0.1:{c.engine_port}"]


async def test_a_gateway_killed_mid_burst_frees_its_leases_and_the_caps_stay_exact(
        tmp_path, figures):
    """Two gateways share one engine's limits through Redis (2 in flight, no queue). The
    second holds both slots when it is SIGKILLed: the survivor admits nothing until those
    leases expire (after the dead gateway's 3 s TTL), then exactly 2 of a burst of 6."""
    import subprocess
    import sys

    from services.common.redis_server import free_port
    from tests.e2e.conftest import ROOT

    c = start_cluster(tmp_path, "--max-inflight", "2", "--max-queue", "0")
    port_b = free_port()
    b = subprocess.Popen(
        [sys.executable, "-m", "services.gateway", "--port", str(port_b), "--engine",
         f"127.0.0.1:{c.engine_port}", "--redis-url", c.redis_url, "--max-inflight", "2",
         "--max-queue", "0", "--lease-ttl-s", "3", "--metrics-port", "0"],
        cwd=ROOT, stdout=(tmp_path / "gateway-b.log").open("w"), stderr=subprocess.STDOUT)
    gateway_b = RunningCluster(b, port_b, 0, c.engine_port, c.cachemgr_port, c.log_dir,
                               tmp_path / "gateway-b.log")
    held: list[asyncio.Task] = []
    try:
        async with aiohttp.ClientSession() as session:
            await wait_for("the second gateway ready", lambda: _status_is(session, gateway_b,
                                                                          200), 60)
            starts = [asyncio.Event() for _ in range(2)]
            held = [asyncio.create_task(stream(session, gateway_b, LONG, e)) for e in starts]
            await wait_for("2 streams through the second gateway",
                           lambda: all(e.is_set() for e in starts), 60)
            burst = await asyncio.gather(*(complete(session, c) for _ in range(6)))
            assert [s[0] for s in burst] == [429] * 6, burst  # the 2 slots are held elsewhere

            b.kill()
            b.wait(10)
            killed_at = time.monotonic()
            ends = await asyncio.gather(*held)
            assert all(e["ends"] == {"cut": 1} for e in ends), ends

            freed = await wait_for("the dead gateway's leases expire", lambda: _admits(
                session, c), 30, poll_s=0.25)
            assert time.monotonic() - killed_at >= 2.5  # not before the TTL (3 s) ran out
            starts = [asyncio.Event() for _ in range(6)]
            held = [asyncio.create_task(stream(session, c, LONG, e)) for e in starts]
            await wait_for("2 of 6 streams admitted",
                           lambda: sum(e.is_set() for e in starts) == 2
                           and sum(t.done() for t in held) == 4, 60)
            rejected = [t.result() for t in held if t.done()]
            assert [r["status"] for r in rejected] == [429] * 4, rejected
            await asyncio.sleep(1.0)  # nothing else gets in while the two run
            assert sum(e.is_set() for e in starts) == 2
            figures(f"killed gateway's 2 leases freed {freed:.1f} s after SIGKILL (TTL 3 s); "
                    "then exactly 2 of 6 admitted, 4 rejected with 429")
            for task in held:
                task.cancel()
    finally:
        if b.poll() is None:
            b.kill()
        for task in held:
            task.cancel()
        assert stop_cluster(c) == 0, c.output.read_text()[-3000:]


async def _admits(session: aiohttp.ClientSession, c: RunningCluster) -> bool:
    status, _, body = await complete(session, c)
    assert status in (200, 429), body
    return status == 200
