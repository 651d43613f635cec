"""Admission caps and Retry-After, driven directly on a local ledger (no HTTP, no engine)."""

import asyncio

import pytest

from services.gateway.admission import Admission, Rejected
from services.gateway.ledger import Limits, LocalLedger


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(engines=("e0",), max_inflight=1, max_queue=2, max_queued_tokens=10**6, **kwargs):
    ledger = LocalLedger(Limits(max_inflight, max_queue, max_queued_tokens))
    return Admission(ledger, engines, **kwargs)


async def settle():
    for _ in range(5):  # ledger releases and the dispatcher run as tasks
        await asyncio.sleep(0)


async def test_a_slot_given_back_is_not_refused_while_its_release_is_on_its_way():
    """A release reaches the ledger in a task, after the response that ended it: a client's
    next request can come first, and must not be refused for the slot it just gave back."""
    admission = make(max_inflight=1, max_queue=0)
    first = await admission.enter()
    admission.release(first)
    second = await admission.enter()  # the ledger has not heard of the release yet
    assert second.engine == "e0"
    with pytest.raises(Rejected):  # and the cap still holds
        await admission.enter()
    admission.release(second)


async def test_exact_caps_and_fifo_handoff():
    admission = make(max_inflight=1, max_queue=2)
    running = await admission.enter()
    assert running.engine == "e0"
    first, second = await admission.enter(), await admission.enter()
    assert (first.engine, second.engine) == (None, None)
    with pytest.raises(Rejected) as info:
        await admission.enter()
    assert info.value.reason == "queue_full" and info.value.retry_after_s >= 1
    waits = [asyncio.create_task(admission.acquire(t)) for t in (first, second)]
    await settle()
    admission.release(running, observed=True)
    assert await waits[0] == "e0"
    await settle()
    assert not waits[1].done()
    assert (admission.num_inflight, admission.num_waiting) == (1, 1)
    admission.release(first)
    assert await waits[1] == "e0"
    admission.release(second)
    admission.release(second)  # idempotent
    await settle()
    assert (admission.num_inflight, admission.num_waiting) == (0, 0)
    assert admission.ledger.inflight == {"e0": set()} and admission.ledger.queued == {}


async def test_queued_prompt_token_cap():
    admission = make(max_inflight=1, max_queue=10, max_queued_tokens=100)
    await admission.enter(tokens=5000)  # granted at once: not queued, not counted
    big = await admission.enter(tokens=500)  # the first in an empty queue always fits
    assert big.engine is None
    with pytest.raises(Rejected) as info:
        await admission.enter(tokens=1)
    assert info.value.reason == "queue_full" and "prompt tokens" in str(info.value)
    admission.release(big)
    await settle()
    small = [await admission.enter(tokens=50) for _ in range(2)]
    with pytest.raises(Rejected):
        await admission.enter(tokens=1)  # 100 of 100 queued tokens used
    assert admission.num_waiting == len(small) == 2


async def test_cancelled_waiter_leaves_the_queue():
    admission = make(max_inflight=1, max_queue=1)
    running = await admission.enter()
    queued = await admission.enter()
    wait = asyncio.create_task(admission.acquire(queued))
    await settle()
    wait.cancel()
    with pytest.raises(asyncio.CancelledError):
        await wait
    await settle()
    assert admission.num_waiting == 0
    replacement = await admission.enter()  # the place is free again
    assert replacement.engine is None
    admission.release(running)
    assert await admission.acquire(replacement) == "e0"


async def test_waiter_cancelled_after_grant_hands_the_slot_on():
    admission = make(max_inflight=1, max_queue=2)
    running = await admission.enter()
    a, b = await admission.enter(), await admission.enter()
    wait_a = asyncio.create_task(admission.acquire(a))
    wait_b = asyncio.create_task(admission.acquire(b))
    await settle()
    admission.release(running)
    while a.engine is None:  # the dispatcher grants a ...
        await asyncio.sleep(0)
    assert not wait_a.done()
    wait_a.cancel()  # ... which leaves before it resumes
    with pytest.raises(asyncio.CancelledError):
        await wait_a
    assert await wait_b == "e0"
    assert admission.num_inflight == 1


async def test_queue_timeout():
    admission = make(max_inflight=1, max_queue=1)
    await admission.enter()
    queued = await admission.enter()
    with pytest.raises(Rejected) as info:
        await admission.acquire(queued, timeout_s=0.01)
    assert info.value.reason == "queue_timeout"
    assert admission.num_waiting == 0


async def test_least_loaded_engine_and_readiness():
    admission = make(("e0", "e1"), max_inflight=2, max_queue=1, initially_ready=False)
    with pytest.raises(Rejected) as info:
        await admission.enter()
    assert info.value.reason == "no_engine"
    admission.set_ready("e0", True)
    admission.set_ready("e1", True)
    engines = [(await admission.enter()).engine for _ in range(4)]
    assert sorted(engines) == ["e0", "e0", "e1", "e1"] and engines[:2] != ["e0", "e0"]
    queued = await admission.enter()
    wait = asyncio.create_task(admission.acquire(queued))
    await settle()
    admission.set_ready("e0", False)
    assert not wait.done()  # e1 may still free a slot
    admission.set_ready("e1", False)
    with pytest.raises(Rejected) as info:
        await wait
    assert info.value.reason == "no_engine"


async def test_forward_counts_the_requests_this_gateway_sends_the_same_engine_next():
    admission = make(("e0", "e1"), max_inflight=3, max_queue=2)
    tickets = [await admission.enter() for _ in range(4)]
    on_e0 = [t for t in tickets if t.engine == "e0"]
    assert len(on_e0) == 2
    assert admission.forward(on_e0[0]) == 1  # the other e0 request; e1's are not counted
    assert admission.forward(on_e0[0]) == 1  # forwarding twice counts once
    admission.release(on_e0[1])  # left before it was forwarded: nothing follows any more
    assert admission.forward(on_e0[0]) == 0
    admission.set_ready("e1", False)  # the only ready engine: requests still entering follow
    admission._entering = 2  # two enter() calls waiting for the ledger (Redis)
    assert admission.forward(on_e0[0]) == 2
    admission._entering = 0
    for t in tickets:
        admission.release(t)
    await settle()
    assert admission._unforwarded == {"e0": 0, "e1": 0}


async def test_engine_coming_back_serves_the_queue():
    admission = make(("e0", "e1"), max_inflight=1, max_queue=1)
    admission.set_ready("e1", False)
    await admission.enter()
    queued = await admission.enter()
    admission.set_ready("e1", True)
    assert await admission.acquire(queued) == "e1"


async def test_draining_refuses_new_and_waits_for_admitted():
    admission = make(max_inflight=1, max_queue=1)
    running = await admission.enter()
    admission.drain()
    with pytest.raises(Rejected) as info:
        await admission.enter()
    assert info.value.reason == "draining"
    assert not await admission.wait_idle(0.01)
    asyncio.get_running_loop().call_later(0.02, admission.release, running)
    assert await admission.wait_idle(1.0)


async def test_retry_after_from_observed_duration_and_drain_rate():
    clock = Clock()
    admission = make(("e0", "e1"), max_inflight=2, max_queue=8, clock=clock,
                     prior_duration_s=1.0)
    # capacity 4 at 1 s each: 4 requests/s drain; a newcomer behind nobody waits 1/4 s -> 1
    assert admission.retry_after_s() == 1
    ticket = await admission.enter()
    clock.now += 8.0
    admission.release(ticket, observed=True)  # the first observation replaces the prior
    await settle()
    assert admission.mean_duration_s == pytest.approx(8.0)
    tickets = [await admission.enter() for _ in range(4 + 5)]  # 4 running, 5 queued
    # (5 queued + 1) requests drain at 4 / 8 s = 0.5 per second -> 12 s
    assert admission.retry_after_s() == 12
    clock.now += 3.0
    admission.release(tickets[0], observed=True)  # mean 8 + 0.2 * (3 - 8) = 7 s
    await settle()
    assert admission.mean_duration_s == pytest.approx(7.0)
    # 4 queued now: (4 + 1) / (4 / 7) = 8.75 -> 9
    assert admission.retry_after_s() == 9


def test_refuses_is_what_enter_would_answer_and_counts_pending_entries():
    ledger = LocalLedger(Limits(max_inflight=2, max_queue=1, max_queued_tokens=100))
    engines = ["e0"]
    assert not ledger.refuses(engines, 1)
    assert not ledger.refuses(engines, 1, pending=2)  # 2 slots + 1 queue place: room left
    assert ledger.refuses(engines, 1, pending=3)  # ... taken by 3 entries still at the ledger
    ledger.force_grant("a", "e0")
    ledger.force_grant("b", "e0")
    assert not ledger.refuses(engines, 1)  # the queue has its place
    ledger.force_enqueue("c", 60)
    assert ledger.refuses(engines, 1)  # slots and queue full
    ledger = LocalLedger(Limits(max_inflight=1, max_queue=5, max_queued_tokens=100))
    ledger.force_grant("a", "e0")
    ledger.force_enqueue("b", 60)
    assert not ledger.refuses(engines, 40) and ledger.refuses(engines, 41)  # the token cap


async def test_refusal_answers_without_a_ticket_what_enter_raises():
    admission = make(max_inflight=1, max_queue=1)
    assert admission.refusal() is None
    running, queued = await admission.enter(), await admission.enter()
    refused = admission.refusal(tokens=7)
    assert refused is not None and refused.reason == "queue_full" and "~7" in str(refused)
    with pytest.raises(Rejected) as info:
        await admission.enter(tokens=7)
    assert info.value.reason == refused.reason
    assert (admission.num_inflight, admission.num_waiting) == (1, 1)  # refusals took nothing
    admission.set_ready("e0", False)
    assert admission.refusal().reason == "no_engine"
    admission.set_ready("e0", True)
    admission.drain()
    assert admission.refusal().reason == "draining"
    admission.release(running)
    admission.release(queued)


async def test_a_queued_tickets_new_estimate_counts_against_the_queued_tokens():
    """A prompt known better once the body is read (a stored conversation continued) is
    counted again while the ticket waits: within the cap it stays, over it the ticket leaves
    the queue with a 429's Rejected; a granted ticket is past the queue."""
    admission = make(max_inflight=1, max_queue=4, max_queued_tokens=100)
    running = await admission.enter(10)
    first, second = await admission.enter(10), await admission.enter(10)
    assert (first.engine, second.engine, admission.num_waiting) == (None, None, 2)
    await admission.reestimate(second, 90)  # 10 + 90: within the cap
    assert admission.ledger.queued[second.lease] == 90
    with pytest.raises(Rejected) as info:
        await admission.reestimate(second, 91)
    assert info.value.reason == "queue_full" and "~91" in str(info.value)
    assert second.released and admission.num_waiting == 1
    await settle()  # its release reaches the ledger
    await admission.reestimate(first, 10**6)  # alone in the queue: it fits, as at enter
    await admission.reestimate(running, 10**6)
    assert running.engine == "e0" and not running.released
    for ticket in (running, first):
        admission.release(ticket)
    await settle()
    assert admission.ledger.queued == {} and admission.ledger.inflight == {"e0": set()}


async def test_redis_ledger_requeues_as_the_local_one(redis_server):
    from services.gateway.ledger import RedisLedger

    limits = Limits(max_inflight=1, max_queue=4, max_queued_tokens=100)
    a = RedisLedger(redis_server.url, limits, lease_ttl_s=30)
    b = RedisLedger(redis_server.url, limits, lease_ttl_s=30)  # a second gateway
    assert (await a.enter("a:1", ["e0"], 10)).engine == "e0"
    assert (await a.enter("a:2", ["e0"], 10)).queued
    assert await b.requeue("a:2", 500)  # alone in the queue
    assert (await b.enter("b:1", ["e0"], 10)).rejected  # 500 queued already
    await b.requeue("a:2", 10)
    assert (await b.enter("b:1", ["e0"], 10)).queued
    assert await b.requeue("b:1", 90) and not await b.requeue("b:1", 91)
    assert await a.requeue("a:1", 10**6)  # granted: past the queue
    assert await a.redis.hget(a._queue_keys[1], "b:1") == b"90"
    for lease, engine in (("a:1", "e0"), ("a:2", None), ("b:1", None)):
        await a.release(lease, engine)
    await a.close()
    await b.close()
