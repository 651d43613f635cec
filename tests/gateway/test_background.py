"""Background responses with the official openai client: answered at once as queued, polled to
their end, cancelled here or from another gateway replica (shared Redis), and reported failed
when the engine fails or the gateway running them stops."""

import asyncio
import json
import time

import aiohttp
import grpc
import openai
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from services.gateway.app import init_app
from services.gateway.background import STOPPED
from services.gateway.config import GatewayConfig
from services.gateway.response_store import KEY_PREFIX

from .conftest import MODEL
from .test_overload import _health, _wait_for


def _client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


async def _until(client, response_id, wanted, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while (r := await client.responses.retrieve(response_id)).status not in wanted:
        assert time.monotonic() < deadline, f"still {r.status}, never {wanted}"
        await asyncio.sleep(0.02)
    return r


async def test_a_background_response_is_queued_then_polled_to_its_end(engine, make_gateway):
    servicer, _ = engine
    servicer.hold = asyncio.Event()
    base = await make_gateway()
    async with _client(base) as client:
        queued = await client.responses.create(model=MODEL, input="hi", background=True)
        assert (queued.status, queued.background, queued.output) == ("queued", True, [])
        running = await _until(client, queued.id, {"in_progress"})
        assert running.created_at == queued.created_at
        with pytest.raises(openai.BadRequestError) as unfinished:
            await client.responses.create(model=MODEL, input="more",
                                          previous_response_id=queued.id)
        assert unfinished.value.body["code"] == "previous_response_unfinished"
        servicer.hold.set()
        done = await _until(client, queued.id, {"completed"})
        assert done.output_text == "Hello, world!" and done.usage.output_tokens == 4
        assert (done.background, done.id, done.created_at) == (True, queued.id, queued.created_at)
        again = await client.responses.cancel(queued.id)  # finished: comes back as it is
        assert again.status == "completed"
        later = await client.responses.create(model=MODEL, input="more",
                                              previous_response_id=queued.id)
        assert later.output_text == "Hello, world!"
        plain = await client.responses.create(model=MODEL, input="hi")
        with pytest.raises(openai.BadRequestError) as not_background:
            await client.responses.cancel(plain.id)
        assert not_background.value.body["code"] == "not_background"


async def test_cancelling_a_running_or_queued_response_frees_its_slot(engine, make_gateway):
    servicer, _ = engine
    servicer.hold = asyncio.Event()
    base = await make_gateway(max_inflight=1, max_queue=4)
    async with _client(base) as client:
        running = await client.responses.create(model=MODEL, input="hi", background=True)
        await _until(client, running.id, {"in_progress"})
        await _wait_for(lambda: servicer.running == 1)
        waiting = await client.responses.create(model=MODEL, input="hi", background=True)
        assert (await client.responses.retrieve(waiting.id)).status == "queued"
        cancelled = await client.responses.cancel(waiting.id)
        assert cancelled.status == "cancelled" and len(servicer.requests) == 1
        cancelled = await client.responses.cancel(running.id)
        assert cancelled.status == "cancelled"
        await _wait_for(lambda: len(servicer.cancelled) == 1)  # the engine call, cancelled
        async with aiohttp.ClientSession() as http:
            assert (await _health(http, base))["inflight"] == 0
        servicer.hold.set()
        after = await client.responses.create(model=MODEL, input="hi")  # the slot is free
        assert after.status == "completed"
        assert (await client.responses.retrieve(running.id)).status == "cancelled"


async def test_an_engine_failure_is_stored_in_the_response(engine, make_gateway):
    servicer, _ = engine
    servicer.status_code = grpc.StatusCode.INVALID_ARGUMENT
    base = await make_gateway()
    async with _client(base) as client:
        queued = await client.responses.create(model=MODEL, input="hi", background=True)
        failed = await _until(client, queued.id, {"failed"})
    assert "scripted INVALID_ARGUMENT" in failed.error.message and failed.error.code


async def test_another_replica_cancels_it_and_reports_it_failed_when_its_gateway_stops(
        engine, make_gateway, redis_server):
    servicer, _ = engine
    servicer.hold = asyncio.Event()
    running_here = await make_gateway(redis_url=redis_server.url)
    other = await make_gateway(redis_url=redis_server.url)
    async with _client(running_here) as here, _client(other) as there:
        first = await here.responses.create(model=MODEL, input="hi", background=True)
        assert (await _until(there, first.id, {"in_progress"})).background
        await _wait_for(lambda: servicer.running == 1)
        cancelled = await there.responses.cancel(first.id)  # at the runner's next beat
        assert cancelled.status == "cancelled"
        assert (await here.responses.retrieve(first.id)).status == "cancelled"
        async with aiohttp.ClientSession() as http:
            await _wait_for(lambda: len(servicer.cancelled) == 1)
            assert (await _health(http, running_here))["inflight"] == 0
        # a record its gateway left unfinished, its run mark gone: failed
        r = aioredis.Redis.from_url(redis_server.url)
        second = await here.responses.create(model=MODEL, input="hi", background=True)
        await _until(there, second.id, {"in_progress"})
        record = json.loads(await r.get(KEY_PREFIX + second.id))
        orphan = "resp_" + "0" * 32
        record["response"]["id"] = orphan
        await r.set(KEY_PREFIX + orphan, json.dumps(record))
        stopped = await there.responses.retrieve(orphan)
        assert (stopped.status, stopped.error.message) == ("failed", STOPPED)
        assert (await there.responses.cancel(orphan)).status == "cancelled"
        await r.aclose()
        servicer.hold.set()
        assert (await _until(there, second.id, {"completed"})).output_text == "Hello, world!"


async def test_a_gateway_that_shuts_down_stores_its_runs_as_failed(engine, redis_server):
    servicer, address = engine
    servicer.hold = asyncio.Event()
    config = GatewayConfig(host="127.0.0.1", port=0, engine_addrs=(address,),
                           health_interval_s=0.2, redis_url=redis_server.url)
    runner = web.AppRunner(init_app(config), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    async with _client(f"http://{host}:{port}") as client:
        queued = await client.responses.create(model=MODEL, input="hi", background=True)
        await _until(client, queued.id, {"in_progress"})
        await _wait_for(lambda: servicer.running == 1)
    await runner.cleanup()  # the runs are cancelled, each stored as failed
    r = aioredis.Redis.from_url(redis_server.url)
    stored = json.loads(await r.get(KEY_PREFIX + queued.id))["response"]
    await r.aclose()
    assert (stored["status"], stored["error"]["message"]) == ("failed", STOPPED)
    assert servicer.cancelled


async def test_a_streamed_background_response_is_read_again_and_resumed_from_any_replica(
        engine, make_gateway, redis_server):
    """stream with background: the events are logged as the run goes; the client that made
    it reads them as a stream, and any client (here through another gateway) reads them again
    with GET stream=true, after a sequence number, live to the end. Leaving the stream leaves
    the response running."""
    servicer, _ = engine
    servicer.tokens = ["one", " two", " three", " four"]
    servicer.token_delay_s = 0.05
    here = await make_gateway(redis_url=redis_server.url, stream_interval_ms=0)
    other = await make_gateway(redis_url=redis_server.url)
    async with _client(here) as a, _client(other) as b:
        stream = await a.responses.create(model=MODEL, input="hi", background=True,
                                          stream=True)
        first = []
        async for event in stream:  # leave after the first delta: the run goes on
            first.append(event)
            if event.type == "response.output_text.delta":
                break
        await stream.close()
        assert [e.type for e in first[:3]] == ["response.created", "response.queued",
                                               "response.in_progress"]
        assert first[0].response.status == "queued" and first[0].response.background
        response_id, last = first[0].response.id, first[-1].sequence_number
        resumed = [e async for e in await b.responses.retrieve(
            response_id, stream=True, starting_after=last)]
        assert resumed[0].sequence_number == last + 1
        assert resumed[-1].type == "response.completed"
        texts = [e.delta for e in [*first, *resumed] if e.type == "response.output_text.delta"]
        assert "".join(texts) == "one two three four"
        again = [e async for e in await a.responses.retrieve(response_id, stream=True)]
        assert [e.sequence_number for e in again] == list(range(len(again)))
        assert again[-1].response.output_text == "one two three four"
        async with b.responses.stream(response_id=response_id) as manager:
            assert (await manager.get_final_response()).output_text == "one two three four"
        plain = await a.responses.create(model=MODEL, input="hi", background=True)
        with pytest.raises(openai.BadRequestError) as unlogged:
            await a.responses.retrieve(plain.id, stream=True)
        assert unlogged.value.body["param"] == "stream"


async def test_a_streamed_background_response_cancelled_ends_its_readers(engine,
                                                                          make_gateway):
    servicer, _ = engine
    servicer.hold = asyncio.Event()
    base = await make_gateway(stream_interval_ms=0)
    async with _client(base) as client:
        stream = await client.responses.create(model=MODEL, input="hi", background=True,
                                               stream=True)
        created = await stream.__anext__()
        reader = asyncio.create_task(_drain(stream))
        await _wait_for(lambda: servicer.running == 1)
        assert (await client.responses.cancel(created.response.id)).status == "cancelled"
        events = await asyncio.wait_for(reader, 5)
        assert "response.completed" not in [e.type for e in events]
        servicer.hold.set()


async def _drain(stream):
    return [e async for e in stream]
