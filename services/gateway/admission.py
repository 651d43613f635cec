"""Admission control: exact caps on work at the engines and on the queue in front of them.

    enter() ──> granted (a slot at the least-loaded ready engine)
            ──> queued (FIFO, at most max_queue) ──acquire()──> granted | queue_timeout
            ──> Rejected("queue_full" | "no_engine")  at once, before any engine work

A slot freed by release() goes straight to the oldest waiter, so the caps hold exactly: never more
than max_inflight requests per engine, never more than max_queue waiting. Pure asyncio; no
transport imports, so the caps are tested directly.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

QUEUE_FULL = "queue_full"
QUEUE_TIMEOUT = "queue_timeout"
NO_ENGINE = "no_engine"

_MAX_RETRY_AFTER_S = 600
_EWMA_WEIGHT = 0.2  # of the newest request duration in the running mean


class Rejected(Exception):
    """The gateway turns this request away; `reason` becomes x-strata-drop-reason."""

    def __init__(self, reason: str, retry_after_s: int, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


@dataclass(eq=False)
class Ticket:
    """One request's place: queued, then granted an engine, then released."""

    ticket_id: int
    entered_at: float
    engine: str | None = None
    granted_at: float | None = None
    released: bool = False
    _granted: asyncio.Future[str] | None = field(default=None, repr=False)

    @property
    def queue_wait_s(self) -> float:
        return 0.0 if self.granted_at is None else self.granted_at - self.entered_at


class Admission:
    def __init__(self, engines: Sequence[str], max_inflight: int, max_queue: int, *,
                 no_engine_retry_s: float = 2.0, prior_duration_s: float = 1.0,
                 initially_ready: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        assert engines and max_inflight >= 1 and max_queue >= 0
        self.max_inflight = max_inflight
        self.max_queue = max_queue
        self._inflight = dict.fromkeys(engines, 0)
        self._ready = dict.fromkeys(engines, initially_ready)
        self._waiting: OrderedDict[int, Ticket] = OrderedDict()
        self._ids = itertools.count()
        self._clock = clock
        self._no_engine_retry_s = no_engine_retry_s
        # Exponentially weighted mean of how long a granted request holds its slot; the prior
        # only stands until the first request completes.
        self._mean_duration_s = prior_duration_s
        self.num_completed = 0

    # -- figures -------------------------------------------------------------------------------

    @property
    def num_inflight(self) -> int:
        return sum(self._inflight.values())

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def ready_engines(self) -> list[str]:
        return [e for e, ready in self._ready.items() if ready]

    @property
    def capacity(self) -> int:
        return self.max_inflight * len(self.ready_engines)

    @property
    def mean_duration_s(self) -> float:
        return self._mean_duration_s

    def retry_after_s(self) -> int:
        """Seconds until a new request would likely get a slot.

        The engines drain `capacity / mean_duration_s` requests per second; a newcomer waits for
        everyone queued ahead of it plus itself to drain."""
        if not self.capacity:
            return max(1, math.ceil(self._no_engine_retry_s))
        drain_per_s = self.capacity / self._mean_duration_s
        wait_s = (self.num_waiting + 1) / drain_per_s
        return min(_MAX_RETRY_AFTER_S, max(1, math.ceil(wait_s)))

    # -- engine readiness ----------------------------------------------------------------------

    def set_ready(self, engine: str, ready: bool) -> None:
        if self._ready[engine] == ready:
            return
        self._ready[engine] = ready
        if ready:
            self._dispatch()
        elif not self.capacity:
            # Nobody can serve the queue: tell waiters now instead of at their deadline.
            for ticket in list(self._waiting.values()):
                self._drop(ticket, self._no_engine())

    # -- the request path ----------------------------------------------------------------------

    def enter(self) -> Ticket:
        """Grant, queue or reject at once; never waits. Raises Rejected."""
        if not self.capacity:
            raise self._no_engine()
        ticket = Ticket(next(self._ids), self._clock())
        engine = self._free_engine()
        if engine is not None and not self._waiting:
            self._grant(ticket, engine)
        elif len(self._waiting) < self.max_queue:
            ticket._granted = asyncio.get_running_loop().create_future()
            self._waiting[ticket.ticket_id] = ticket
        else:
            raise Rejected(QUEUE_FULL, self.retry_after_s(),
                           f"{self.num_inflight} requests running and {self.num_waiting} queued "
                           f"(limits {self.max_inflight} per engine, queue {self.max_queue})")
        return ticket

    async def acquire(self, ticket: Ticket, timeout_s: float | None = None) -> str:
        """Wait for the ticket's engine slot. Leaving (cancel, timeout) gives up the place."""
        if ticket.engine is not None:
            return ticket.engine
        assert ticket._granted is not None
        if ticket._granted.done():  # dropped while the request was still being read
            return ticket._granted.result()
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(ticket._granted)
        except TimeoutError:
            self.release(ticket)
            raise Rejected(QUEUE_TIMEOUT, self.retry_after_s(),
                           f"waited {timeout_s:.1f} s in the queue without an engine slot") from None
        except asyncio.CancelledError:
            self.release(ticket)  # also hands on a slot granted in the meantime
            raise

    def release(self, ticket: Ticket, *, observed: bool = False) -> None:
        """End the ticket (idempotent). `observed`: its duration feeds Retry-After."""
        if ticket.released:
            return
        ticket.released = True
        self._waiting.pop(ticket.ticket_id, None)
        if ticket.engine is None:
            if ticket._granted is not None and not ticket._granted.done():
                ticket._granted.cancel()
            return
        self._inflight[ticket.engine] -= 1
        assert self._inflight[ticket.engine] >= 0
        if observed and ticket.granted_at is not None:
            duration_s = max(self._clock() - ticket.granted_at, 1e-3)
            weight = 1.0 if self.num_completed == 0 else _EWMA_WEIGHT  # the prior yields at once
            self._mean_duration_s += weight * (duration_s - self._mean_duration_s)
            self.num_completed += 1
        self._dispatch()

    # -- internals -----------------------------------------------------------------------------

    def _free_engine(self) -> str | None:
        candidates = [e for e in self.ready_engines if self._inflight[e] < self.max_inflight]
        return min(candidates, key=self._inflight.__getitem__, default=None)

    def _grant(self, ticket: Ticket, engine: str) -> None:
        self._inflight[engine] += 1
        ticket.engine = engine
        ticket.granted_at = self._clock()

    def _dispatch(self) -> None:
        while self._waiting and (engine := self._free_engine()) is not None:
            _, ticket = self._waiting.popitem(last=False)
            self._grant(ticket, engine)
            assert ticket._granted is not None
            ticket._granted.set_result(engine)

    def _drop(self, ticket: Ticket, error: Rejected) -> None:
        self._waiting.pop(ticket.ticket_id, None)
        ticket.released = True
        if ticket._granted is not None and not ticket._granted.done():
            ticket._granted.set_exception(error)

    def _no_engine(self) -> Rejected:
        return Rejected(NO_ENGINE, self.retry_after_s(),
                        "no engine is ready; the gateway retries them every few seconds")
