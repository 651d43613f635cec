"""prompt_cache_key: a key's requests go to one engine while it has a slot (admission.place),
so that a conversation's turns meet their prefix's KV where it is. The ledger's steps in this
process and in a real Redis, admission driven directly, then two scripted gRPC engines behind a
real gateway with the official openai client."""

import asyncio
import itertools

import aiohttp
import pytest
from openai import AsyncOpenAI, BadRequestError

from services.gateway.admission import Admission, key_engine
from services.gateway.ledger import Limits, LocalLedger, RedisLedger, SharedLedger

from .conftest import MODEL, ScriptedEngine, start_engine
from .test_overload import _health

ENGINES = ("e0", "e1")
CHAT = [{"role": "user", "content": "hello there"}]


def key_for(engine: str, engines=ENGINES) -> str:
    """A cache key that belongs to `engine` among `engines`."""
    return next(k for i in itertools.count() if key_engine(k := f"conv-{i}", engines) == engine)


async def settle():
    for _ in range(5):  # ledger releases and the dispatcher run as tasks
        await asyncio.sleep(0)


def test_a_key_belongs_to_one_engine_and_an_engine_leaving_moves_only_its_own_keys():
    engines = [f"10.0.0.{i}:50051" for i in range(4)]
    keys = [f"conv-{i}" for i in range(400)]
    owner = {k: key_engine(k, engines) for k in keys}
    assert owner == {k: key_engine(k, list(reversed(engines))) for k in keys}  # order-free
    assert min(list(owner.values()).count(e) for e in engines) > 60  # spread over all four
    left = [e for e in engines if e != engines[2]]
    assert all(key_engine(k, left) == owner[k] for k in keys if owner[k] != engines[2])


async def test_local_ledger_moves_a_lease_only_into_a_free_slot():
    ledger = LocalLedger(Limits(max_inflight=1, max_queue=4, max_queued_tokens=100))
    assert (await ledger.enter("a", ENGINES, 1)).engine == "e0"
    assert await ledger.move("a", "e0", "e1")
    assert ledger.inflight == {"e0": set(), "e1": {"a"}}
    assert (await ledger.enter("b", ENGINES, 1)).engine == "e0"
    assert not await ledger.move("b", "e0", "e1")  # e1 is full: b stays
    assert not await ledger.move("gone", "e0", "e1")
    assert (await ledger.enter("c", ENGINES, 1)).queued
    await ledger.release("a", "e1")
    await ledger.release("b", "e0")
    assert await ledger.grant_queued("c", ENGINES, prefer="e1") == "e1"  # both free: preferred


async def test_redis_ledger_moves_and_prefers_as_the_local_one(redis_server):
    limits = Limits(max_inflight=1, max_queue=4, max_queued_tokens=100)
    a = RedisLedger(redis_server.url, limits, lease_ttl_s=30)
    b = RedisLedger(redis_server.url, limits, lease_ttl_s=30)  # a second gateway
    assert (await a.enter("a:1", ENGINES, 1)).engine == "e0"
    assert await a.move("a:1", "e0", "e1")
    assert (await b.enter("b:1", ENGINES, 1)).engine == "e0"
    assert not await b.move("b:1", "e0", "e1")  # full across gateways
    assert not await b.move("b:9", "e0", "e1")  # no such lease at the source
    assert (await b.enter("b:2", ENGINES, 1)).queued
    await a.release("a:1", "e1")
    await b.release("b:1", "e0")
    assert await b.grant_queued("b:2", ENGINES, prefer="e1") == "e1"
    r = a.redis
    assert [await r.zrange(a.inflight_key(e), 0, -1) for e in ENGINES] == [[], [b"b:2"]]
    await b.release("b:2", "e1")
    await a.close()
    await b.close()


def make(max_inflight=1, ledger=None):
    ledger = ledger or LocalLedger(Limits(max_inflight, 4, 10**6))
    return Admission(ledger, ENGINES)


async def test_place_moves_a_granted_ticket_to_its_keys_engine_while_it_has_a_slot():
    admission = make(max_inflight=2)
    first = await admission.enter()
    assert first.engine == "e0"  # least loaded, before the body is read
    await admission.place(first, key_for("e1"))
    assert first.engine == "e1" and (admission.load("e0"), admission.load("e1")) == (0, 1)
    same = await admission.enter()
    await admission.place(same, key_for("e1"))
    assert same.engine == "e1"
    full = await admission.enter()
    await admission.place(full, key_for("e1"))
    assert full.engine == "e0"  # e1 holds its two: load wins over the hint
    for ticket in (first, same, full):
        admission.release(ticket)
    await settle()
    assert admission.ledger.inflight == {"e0": set(), "e1": set()}


async def test_place_changes_nothing_without_a_key_or_a_second_engine():
    admission = make()
    ticket = await admission.enter()
    await admission.place(ticket, None)
    assert ticket.engine == "e0" and ticket.prefer is None
    admission.set_ready("e1", False)
    await admission.place(ticket, key_for("e1"))
    assert ticket.engine == "e0"
    admission.release(ticket)


async def test_a_queued_ticket_is_granted_at_its_keys_engine():
    admission = make(max_inflight=1)
    running = [await admission.enter(), await admission.enter()]
    assert sorted(t.engine for t in running) == ["e0", "e1"]
    queued = await admission.enter()
    await admission.place(queued, key_for("e1"))
    waiter = asyncio.create_task(admission.acquire(queued))
    admission.release(running[0])  # e0 frees first: the queued ticket takes it (load wins)
    assert await waiter == "e0"
    admission.release(running[1])
    admission.release(queued)
    await settle()
    # both free when the dispatcher grants: the key's engine
    running = [await admission.enter(), await admission.enter()]
    queued = await admission.enter()
    await admission.place(queued, key_for("e1"))
    waiter = asyncio.create_task(admission.acquire(queued))
    await settle()
    for ticket in running:
        admission.release(ticket)
    assert await waiter == "e1"
    admission.release(queued)


class SlowMoves(LocalLedger):
    """A ledger whose move answers when the test lets it (a Redis round trip in flight)."""

    def __init__(self, limits: Limits) -> None:
        super().__init__(limits)
        self.answer = asyncio.Event()

    async def move(self, lease: str, source: str, target: str) -> bool:
        moved = await super().move(lease, source, target)
        await self.answer.wait()
        return moved


async def test_a_request_cancelled_while_its_lease_moves_leaves_no_lease_behind():
    ledger = SlowMoves(Limits(1, 4, 10**6))
    admission = make(ledger=ledger)
    ticket = await admission.enter()
    placing = asyncio.create_task(admission.place(ticket, key_for("e1")))
    await settle()
    placing.cancel()  # the client left: the handler releases its ticket at once
    admission.release(ticket)
    ledger.answer.set()
    await settle()
    assert ledger.inflight == {"e0": set(), "e1": set()}
    assert admission.num_inflight == 0


async def test_shared_ledger_mirrors_a_move(redis_server):
    ledger = SharedLedger(redis_server.url, Limits(1, 4, 10**6), lease_ttl_s=30)
    await ledger.start()
    admission = make(ledger=ledger)
    ticket = await admission.enter()
    await admission.place(ticket, key_for("e1"))
    assert ticket.engine == "e1" and ledger.local.inflight == {"e0": set(), "e1": {ticket.lease}}
    admission.release(ticket)
    await settle()
    await asyncio.sleep(0.05)
    assert await ledger.remote.redis.zcard(ledger.remote.inflight_key("e1")) == 0
    await admission.close()
    await ledger.close()


@pytest.fixture
async def two_engines():
    servicers = [ScriptedEngine(), ScriptedEngine()]
    started = [await start_engine(s) for s in servicers]
    yield servicers, tuple(f"127.0.0.1:{port}" for _, port in started)
    for server, _ in started:
        await server.stop(grace=None)


async def _both_ready(base):
    async with aiohttp.ClientSession() as http:
        for _ in range(100):
            body = await _health(http, base)
            if sum(e.get("ready", False) for e in body["engines"]) == 2:
                return
            await asyncio.sleep(0.05)
    raise AssertionError("the gateway never saw both engines ready")


async def test_requests_with_a_key_reach_its_engine_through_the_gateway(make_gateway,
                                                                        two_engines):
    servicers, addresses = two_engines
    base = await make_gateway(engine_addrs=addresses)
    await _both_ready(base)
    seen = lambda: [len(s.requests) for s in servicers]  # noqa: E731
    async with AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0) as client:
        for _ in range(3):  # idle engines: without a key, the first one
            await client.chat.completions.create(model=MODEL, messages=CHAT)
        assert seen() == [3, 0]
        second = key_for(addresses[1], addresses)
        for _ in range(3):
            await client.chat.completions.create(model=MODEL, messages=CHAT,
                                                 prompt_cache_key=second)
            await client.completions.create(model=MODEL, prompt="hi",
                                            extra_body={"prompt_cache_key": second})
        assert seen() == [3, 6]
        response = await client.responses.create(model=MODEL, input="hi",
                                                 prompt_cache_key=second, store=False)
        assert response.prompt_cache_key == second and seen() == [3, 7]
        with pytest.raises(BadRequestError) as info:
            await client.chat.completions.create(model=MODEL, messages=CHAT,
                                                 prompt_cache_key="")
        assert info.value.body["param"] == "prompt_cache_key"


async def test_a_stored_conversation_keeps_to_its_first_responses_engine(make_gateway,
                                                                         two_engines):
    servicers, addresses = two_engines
    base = await make_gateway(engine_addrs=addresses)
    await _both_ready(base)
    homes = set()
    async with AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0) as client:
        while len(homes) < 2:  # until a conversation has lived at each engine (idle engines:
            #                    without its key, every turn would go to the first)
            before = [len(s.requests) for s in servicers]
            first = await client.responses.create(model=MODEL, input="hi")
            assert first.prompt_cache_key is None  # the key given, as OpenAI echoes it
            previous = first.id
            for _ in range(3):
                previous = (await client.responses.create(
                    model=MODEL, input="and?", previous_response_id=previous)).id
            home = addresses.index(key_engine(first.id, addresses))
            assert [len(s.requests) - n for s, n in zip(servicers, before, strict=True)] == \
                [4 - 4 * home, 4 * home]
            homes.add(home)
