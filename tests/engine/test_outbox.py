"""server.Outbox, Inbox and coalesce: how engine events cross from the loop thread to gRPC."""

from __future__ import annotations

import asyncio
import threading

from services.engine.requests import Delta, Finished, RequestStats, Started
from services.engine.server import Inbox, Outbox, coalesce


def test_coalesce_joins_consecutive_deltas_only():
    a, b, c = Delta("a", (1,)), Delta("b", (2, 3)), Delta("", ())
    done = Finished("stop", RequestStats())
    out = coalesce([Started(3, 64), a, b, c, done])
    assert out[0] == Started(3, 64) and out[-1] is done and len(out) == 3
    assert out[1] == Delta("ab", (1, 2, 3))
    assert coalesce([a]) == [a] and coalesce([]) == []


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
