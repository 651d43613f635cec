"""server.Outbox, Inbox and message_of: how engine events cross from the loop thread to gRPC."""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import pytest

from services.common.settings import ConfigError, resolve
from services.engine import server
from services.engine.config import SETTINGS
from services.engine.requests import Delta, Finished, RequestStats, Started
from services.engine.server import Inbox, Outbox, message_of


def test_a_wake_ups_events_go_out_as_one_message():
    a, b, c = Delta("a", (1,)), Delta("b", (2, 3)), Delta("", ())
    done = Finished("length", RequestStats(completion_tokens=3))
    message = message_of([Started(3, 64), a, b, c, done], "e1")
    assert message.started.prompt_tokens == 3 and message.started.engine_id == "e1"
    assert message.delta.text == "ab" and list(message.delta.token_ids) == [1, 2, 3]
    assert message.finished.stats.completion_tokens == 3
    alone = message_of([a], "e1")
    assert alone.HasField("delta") and not alone.HasField("started")
    assert not alone.HasField("finished")
    assert not message_of([done], "e1").HasField("delta")


async def test_engine_thread_events_wait_for_the_end_of_the_step():
    outbox = Outbox(asyncio.get_running_loop())
    inboxes = [Inbox(), Inbox()]

    def step(n: int) -> None:  # what the engine's loop thread does: emit, then after_step
        for i in range(n):
            outbox.put(inboxes[i % 2], Delta(str(i), (i,)))

    def run_steps(ready: threading.Event, go: threading.Event, emitted: threading.Event):
        outbox.flush()  # a first after_step: the outbox now knows the stepping thread
        ready.set()
        go.wait()
        step(4)
        emitted.set()
        go.clear()
        go.wait()
        outbox.flush()

    ready, go, emitted = threading.Event(), threading.Event(), threading.Event()
    thread = threading.Thread(target=run_steps, args=(ready, go, emitted))
    thread.start()
    await asyncio.to_thread(ready.wait)
    go.set()
    await asyncio.to_thread(emitted.wait)
    await asyncio.sleep(0.05)  # the loop runs: nothing was scheduled before the step's end
    assert inboxes[0].take_nowait() == [] and inboxes[1].take_nowait() == []
    go.set()
    await asyncio.to_thread(thread.join)
    got = [await asyncio.wait_for(inbox.take(), 5) for inbox in inboxes]
    assert got == [[Delta("0", (0,)), Delta("2", (2,))], [Delta("1", (1,)), Delta("3", (3,))]]


async def test_events_from_other_threads_are_delivered_at_once():
    outbox = Outbox(asyncio.get_running_loop())
    inbox = Inbox()
    outbox.put(inbox, Started(1, 8))  # submit() runs on the event loop's thread
    assert await asyncio.wait_for(inbox.take(), 5) == [Started(1, 8)]
    await asyncio.to_thread(outbox.put, inbox, Finished("abort", RequestStats()))  # shutdown
    assert (await asyncio.wait_for(inbox.take(), 5))[0].reason == "abort"


async def test_a_started_waits_for_the_step_that_computes_its_first_tokens():
    outbox = Outbox(asyncio.get_running_loop())
    inbox = Inbox()
    stepping, submitted = threading.Event(), threading.Event()

    def loop_thread() -> None:
        outbox.flush()  # an after_step: the engine's loop thread is stepping
        stepping.set()
        submitted.wait(5)
        outbox.put(inbox, Delta("a", (5,)))  # the step's first token, then its after_step
        outbox.flush()

    thread = threading.Thread(target=loop_thread)
    thread.start()
    await asyncio.to_thread(stepping.wait, 5)
    outbox.put(inbox, Started(1, 8))  # submit() runs on the event loop's thread
    await asyncio.sleep(0.05)
    assert inbox.take_nowait() == []  # not alone: it waits for the step
    submitted.set()
    await asyncio.to_thread(thread.join)
    assert await asyncio.wait_for(inbox.take(), 5) == [Started(1, 8), Delta("a", (5,))]


async def test_held_tokens_wake_nothing_until_a_step_ends_after_their_interval():
    """A call holding its tokens (a stream interval) is not woken by the steps that emit
    them: they pile up in its inbox until the first step's end after the interval, even a
    step that added none of its events; its Finished wakes it at once."""
    loop = asyncio.get_running_loop()
    outbox = Outbox(loop)
    inbox, other = Inbox(interval_s=1.0), Inbox()
    wakes = []
    deliver = outbox._deliver
    outbox._deliver = lambda: (wakes.append(1), deliver())[1]

    def steps(n: int, first: int, box: Inbox = inbox, finish: bool = False) -> None:
        for i in range(first, first + n):  # the engine's loop thread: emit, then after_step
            outbox.put(box, Delta(str(i), (i,)))
            if finish and i == first + n - 1:
                outbox.put(box, Finished("length", RequestStats(completion_tokens=i + 1)))
            outbox.flush()

    taking = asyncio.ensure_future(inbox.take())  # waits: the first step wakes it
    await asyncio.sleep(0)
    await asyncio.to_thread(steps, 1, 0)
    assert await asyncio.wait_for(taking, 5) == [Delta("0", (0,))] and len(wakes) == 1
    holding = asyncio.ensure_future(inbox.take())
    await asyncio.to_thread(steps, 5, 1)  # held: five steps, no wake-up
    await asyncio.sleep(0.05)
    assert not holding.done() and len(wakes) == 1
    await asyncio.sleep(1.0)  # the interval has passed: still no timer wakes it ...
    assert not holding.done() and len(wakes) == 1
    await asyncio.to_thread(steps, 1, 0, other)  # ... but the next step's end does
    assert [e.text for e in await asyncio.wait_for(holding, 5)] == ["1", "2", "3", "4", "5"]
    holding = asyncio.ensure_future(inbox.take())
    await asyncio.to_thread(steps, 2, 6, finish=True)  # the Finished ends the hold at once
    events = await asyncio.wait_for(holding, 5)
    assert [e.text for e in events[:-1]] == ["6", "7"] and isinstance(events[-1], Finished)


async def test_an_abort_from_another_thread_follows_what_waits_for_the_step():
    outbox = Outbox(asyncio.get_running_loop())
    inbox = Inbox()
    stepping = threading.Thread(target=outbox.flush)  # the engine's loop thread is stepping
    stepping.start()
    stepping.join()  # (a flush takes no time)
    outbox.put(inbox, Started(1, 8))  # submitted: waits for the next step's end
    # shutdown's abort, from a thread started after the loop thread ended: it usually gets the
    # dead thread's ident, and is still another thread
    stopping = threading.Thread(target=outbox.put,
                                args=(inbox, Finished("abort", RequestStats())))
    stopping.start()
    stopping.join()
    events = await asyncio.wait_for(inbox.take(), 5)
    assert events[0] == Started(1, 8) and events[1].reason == "abort"


async def test_a_flush_with_first_messages_returns_once_they_are_written(monkeypatch):
    monkeypatch.setattr(server, "FIRST_MESSAGE_WAIT_S", 60.0)  # longer than any join below
    outbox = Outbox(asyncio.get_running_loop())
    first, running = Inbox(), Inbox()

    def step() -> None:
        outbox.flush()  # the stepping thread's first after_step
        outbox.put(running, Delta("b", (2,)))  # a running request's tokens: nothing to wait for
        outbox.put(first, Started(3, 64))
        outbox.put(first, Delta("a", (1,)))
        outbox.flush()

    stepping = threading.Thread(target=step)
    stepping.start()
    assert await asyncio.wait_for(first.take(), 5) == [Started(3, 64), Delta("a", (1,))]
    await asyncio.sleep(0.05)
    assert stepping.is_alive()  # its first message is taken, not yet written
    first.first_out()  # the gRPC writer wrote it
    await asyncio.to_thread(stepping.join, 10)
    assert not stepping.is_alive()
    # a step with no request's first message returns at once
    again = threading.Thread(target=lambda: (outbox.put(running, Delta("c", (3,))),
                                             outbox.flush()))
    again.start()
    await asyncio.to_thread(again.join, 10)
    assert not again.is_alive()


async def test_after_first_messages_are_written_the_flush_leaves_the_gateway_its_grace():
    grace_s = 0.2
    outbox = Outbox(asyncio.get_running_loop(), first_token_grace_s=grace_s)
    first, running = Inbox(), Inbox()
    steps: queue.Queue[tuple[tuple[Inbox, object], ...]] = queue.Queue()
    returned: queue.Queue[float] = queue.Queue()

    def loop_thread() -> None:  # emits a step's events, then after_step, step after step
        outbox.flush()  # the stepping thread's first after_step
        while events := steps.get():
            for box, event in events:
                outbox.put(box, event)
            outbox.flush()
            returned.put(time.monotonic())

    stepping = threading.Thread(target=loop_thread, daemon=True)  # a failed assert: left
    stepping.start()
    steps.put(((first, Started(3, 64)), (first, Delta("a", (1,)))))
    assert await asyncio.wait_for(first.take(), 5) == [Started(3, 64), Delta("a", (1,))]
    written = time.monotonic()
    first.first_out()
    assert await asyncio.to_thread(returned.get, True, 10) - written >= grace_s
    # a step with only running requests' tokens has no first message to make way for
    started = time.monotonic()
    steps.put(((running, Delta("b", (2,))),))
    assert await asyncio.to_thread(returned.get, True, 10) - started < grace_s
    steps.put(())
    await asyncio.to_thread(stepping.join, 10)


@pytest.mark.parametrize(("setting", "device", "threads", "cores", "grace_s"), [
    (None, "cpu", 2, 2, server.FIRST_TOKEN_GRACE_MS / 1e3),  # every core computes
    (None, "cpu", 1, 2, 0.0),  # a core to spare for the gateway
    (None, "cuda", 16, 16, 0.0),  # a GPU step leaves the CPU's cores free
    (0.0, "cpu", 2, 2, 0.0),
    (2.5, "cuda", 4, 16, 0.0025),  # set: as set
])
def test_the_grace_is_auto_where_the_engines_threads_take_every_core(setting, device, threads,
                                                                    cores, grace_s):
    assert server.first_token_grace_s(setting, device, threads, cores) == grace_s


def test_the_grace_setting_takes_auto_or_milliseconds():
    assert resolve(SETTINGS, environ={})["first_token_grace_ms"] is None
    assert resolve(SETTINGS, environ={"STRATA_FIRST_TOKEN_GRACE_MS": "auto"}
                   )["first_token_grace_ms"] is None
    assert resolve(SETTINGS, environ={"STRATA_FIRST_TOKEN_GRACE_MS": "0"}
                   )["first_token_grace_ms"] == 0.0
    with pytest.raises(ConfigError, match="STRATA_FIRST_TOKEN_GRACE_MS"):
        resolve(SETTINGS, environ={"STRATA_FIRST_TOKEN_GRACE_MS": "-1"})
