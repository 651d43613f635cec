"""Admission caps, queue behaviour and cancellation, through real HTTP and gRPC."""

import asyncio
import time

import aiohttp
import pytest

from .conftest import MODEL

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


class FakeClock:
    """A gateway clock that moves only when the test moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def _post(http, base, body=BODY, **kwargs):
    async with http.post(base + "/v1/chat/completions", json=body, **kwargs) as resp:
        payload = await resp.json()
        return resp.status, dict(resp.headers), payload


async def _wait_for(predicate, timeout_s=3.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def _health(http, base):
    """Cheap gateway state (/readyz): counts, engines; never calls an engine."""
    async with http.get(base + "/readyz") as resp:
        return await resp.json()


async def _wait_ready(http, base, timeout_s=5.0):
    """Until /readyz is 200 (the gateway probes engines every 0.2 s in tests)."""
    deadline = time.monotonic() + timeout_s
    while (await _health(http, base))["status"] != "ok":
        assert time.monotonic() < deadline, "the gateway did not become ready"
        await asyncio.sleep(0.05)


async def test_exact_caps_under_overload(make_gateway, engine):
    servicer, _ = engine
    servicer.hold = asyncio.Event()  # admitted requests wait for their first token till released
    base = await make_gateway(max_inflight=1, max_queue=2)
    async with aiohttp.ClientSession() as http:
        tasks = [asyncio.create_task(_post(http, base)) for _ in range(10)]
        # Every rejection comes back while the admitted ones are still held: none waits for
        # the queue or the engine, whatever the machine's speed.
        await _wait_for(lambda: sum(t.done() for t in tasks) >= 7 and servicer.running == 1)
        rejected = [t.result() for t in tasks if t.done()]
        assert len(rejected) == 7
        servicer.hold.set()
        results = await asyncio.gather(*tasks)
        health = await _health(http, base)
    ok = [r for r in results if r[0] == 200]
    assert (len(ok), sum(r[0] == 429 for r in results)) == (3, 7)
    assert all(r[2]["choices"][0]["message"]["content"] == "Hello, world!" for r in ok)
    for status, headers, payload in rejected:
        assert status == 429 and headers["x-strata-drop-reason"] == "queue_full"
        assert int(headers["Retry-After"]) >= 1
        assert payload["error"]["type"] == "rate_limit_exceeded"
        assert payload["error"]["code"] == "queue_full"
    assert len(servicer.requests) == 3  # rejected requests cost the engine nothing
    assert servicer.max_running_seen == 1
    assert (health["inflight"], health["queued"]) == (0, 0)


@pytest.mark.parametrize(("duration_s", "retry_after"), [(0.3, "1"), (1.2, "3"), (2.6, "6")])
async def test_retry_after_follows_observed_duration(make_gateway, engine, duration_s,
                                                     retry_after):
    """One slot, one request observed to hold it for duration_s (on the gateway's clock, moved
    by the test; the 1 s prior yields to it): a newcomer behind one running and one queued
    request waits for both to drain, ceil(2 x duration_s)."""
    servicer, _ = engine
    clock = FakeClock()
    base = await make_gateway(max_inflight=1, max_queue=1, clock=clock)
    async with aiohttp.ClientSession() as http:
        servicer.hold = asyncio.Event()
        observed = asyncio.create_task(_post(http, base))
        await _wait_for(lambda: servicer.running == 1)
        clock.now += duration_s
        servicer.hold.set()
        assert (await observed)[0] == 200
        servicer.hold = asyncio.Event()
        running = asyncio.create_task(_post(http, base))
        await _wait_for(lambda: servicer.running == 1)
        queued = asyncio.create_task(_post(http, base))
        while (await _health(http, base))["queued"] != 1:
            await asyncio.sleep(0.01)
        status, headers, _ = await _post(http, base)
        servicer.hold.set()
        assert [(await t)[0] for t in (running, queued)] == [200, 200]
    assert status == 429 and headers["x-strata-drop-reason"] == "queue_full"
    assert headers["Retry-After"] == retry_after


async def test_queued_client_leaving_frees_its_place(make_gateway, engine):
    servicer, _ = engine
    servicer.token_delay_s = 0.1
    base = await make_gateway(max_inflight=1, max_queue=1)
    async with aiohttp.ClientSession() as http:
        running = asyncio.create_task(_post(http, base))
        await _wait_for(lambda: servicer.running == 1)
        async with aiohttp.ClientSession() as leaver:
            queued = asyncio.create_task(_post(leaver, base, headers={"X-Request-Id": "leaver"}))
            while (await _health(http, base))["queued"] != 1:
                await asyncio.sleep(0.01)
            queued.cancel()
        await _wait_for_queue_empty(http, base)
        status, *_ = await _post(http, base)  # takes the freed place, then runs
        assert status == 200
        assert (await running)[0] == 200
    assert "leaver" not in [r.request_id for r in servicer.requests]


async def _wait_for_queue_empty(http, base):
    for _ in range(300):
        if (await _health(http, base))["queued"] == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the queued request that left was not removed")


async def test_queue_timeout(make_gateway, engine):
    servicer, _ = engine
    servicer.token_delay_s = 0.2
    base = await make_gateway(max_inflight=1, max_queue=1, queue_timeout_s=0.1)
    async with aiohttp.ClientSession() as http:
        running = asyncio.create_task(_post(http, base))
        await _wait_for(lambda: servicer.running == 1)
        status, headers, payload = await _post(http, base)
        assert (await running)[0] == 200
    assert status == 429 and headers["x-strata-drop-reason"] == "queue_timeout"
    assert payload["error"]["code"] == "queue_timeout"


async def test_client_disconnect_cancels_engine_call(gateway, engine):
    servicer, _ = engine
    servicer.token_delay_s = 5.0
    async with aiohttp.ClientSession() as http:
        task = asyncio.create_task(_post(http, gateway, headers={"X-Request-Id": "gone-1"}))
        await _wait_for(lambda: servicer.running == 1)
        task.cancel()
    await _wait_for(lambda: "gone-1" in servicer.cancelled)
    await _wait_for(lambda: servicer.running == 0)


async def test_streaming_client_disconnect_cancels_engine_call(gateway, engine):
    servicer, _ = engine
    servicer.tokens = ["tok"] * 50
    servicer.token_delay_s = 0.05
    body = {**BODY, "stream": True}
    async with aiohttp.ClientSession() as http, http.post(
            gateway + "/v1/chat/completions", json=body, headers={"X-Request-Id": "gone-2"}) as resp:
        assert resp.status == 200
        await resp.content.readuntil(b"\n\n")  # the role chunk
        await resp.content.readuntil(b"\n\n")  # one token
        resp.close()
    await _wait_for(lambda: "gone-2" in servicer.cancelled)
    assert "gone-2" not in servicer.finished
    async with aiohttp.ClientSession() as http:
        await _wait_for_queue_empty(http, gateway)
        health = await _health(http, gateway)
        assert health["inflight"] == 0


async def test_refused_requests_are_answered_first_and_logged_once_a_second(
        make_gateway, engine, caplog):
    servicer, _ = engine
    servicer.token_delay_s = 0.05
    base = await make_gateway(max_inflight=1, max_queue=0)
    caplog.set_level("INFO", logger="strata.gateway")
    async with aiohttp.ClientSession() as http:
        running = asyncio.create_task(_post(http, base))
        await _wait_for(lambda: len(servicer.requests) == 1)
        results = await asyncio.gather(*(
            _post(http, base, headers={"X-Request-Id": f"burst-{i}"}) for i in range(6)))
        assert (await running)[0] == 200
    for i, (status, headers, payload) in enumerate(results):
        headers = {k.lower(): v for k, v in headers.items()}
        assert status == 429 and payload["error"]["code"] == "queue_full"
        assert headers["x-request-id"] == f"burst-{i}" and int(headers["retry-after"]) >= 1
    assert len(servicer.requests) == 1
    await asyncio.sleep(1.2)  # the window of the rejection log closes
    lines = [r.getMessage() for r in caplog.records if "burst-" in r.getMessage()
             or "rejected" in r.getMessage()]
    assert len(lines) == 2, lines  # the first in full, then the other five as one line
    assert "burst-0" in lines[0] and lines[1].startswith("5 more requests rejected")


async def test_the_bench_burst_client_reads_streams_and_rejections(make_gateway, engine):
    """services.bench.burst (strata bench overload's client) over kept-alive connections:
    chunked SSE streams read to [DONE], rejections with their headers and error codes."""
    from services.bench.burst import burst, http_request

    servicer, _ = engine
    servicer.token_delay_s = 0.05
    base = await make_gateway(max_inflight=1, max_queue=2)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True}
    requests = [http_request(base + "/v1", "/completions", body) for _ in range(10)]
    outcomes = await burst(base + "/v1", requests, time.perf_counter(), settle_s=0.05)
    assert sorted(o.status for o in outcomes) == [200] * 3 + [429] * 7
    assert all(o.ok for o in outcomes if o.status == 200)
    for o in (o for o in outcomes if o.status == 429):
        assert o.error_code == "queue_full" and o.drop_reason == "queue_full"
        assert o.retry_after_s >= 1  # (answered at once: test_exact_caps_under_overload)
