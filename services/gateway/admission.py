"""Admission control: exact caps on work at the engines and on the queue in front of them.

    enter(tokens) ──> granted (a slot at the least-loaded ready engine)
                  ──> queued (FIFO here, at most max_queue and max_queued_tokens in all)
                         ──acquire()──> granted | queue_timeout | no_engine
                  ──> Rejected("queue_full" | "no_engine" | "draining")  at once, before any
                      engine work
    reestimate(ticket, tokens)  once the body is read and the prompt is known better (a
                        Responses conversation continued from the store): a queued ticket's
                        tokens are counted again against max_queued_tokens, 429 if over
    place(ticket, key)  once the body is read: a request with a cache key (prompt_cache_key)
                        goes to the key's engine where that engine has a slot, so that one
                        conversation's turns meet their prompt's KV at the same engine

The counts live in a ledger (ledger.py): this process's, or Redis shared by every gateway, where
each step is one atomic script, so the caps hold exactly across replicas. Waiters here are served
oldest first by one dispatcher task, woken by every local release and readiness change, and
polling every `poll_s` while others' releases (shared ledger) may free a slot. No transport
imports, so the caps are tested directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import math
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from services.gateway.ledger import Ledger

log = logging.getLogger("strata.gateway.admission")

QUEUE_FULL = "queue_full"
QUEUE_TIMEOUT = "queue_timeout"
NO_ENGINE = "no_engine"
DRAINING = "draining"
UNAVAILABLE_REASONS = (NO_ENGINE, DRAINING)  # 503; the rest are 429

_MAX_RETRY_AFTER_S = 600
_EWMA_WEIGHT = 0.2  # of the newest request duration in the running mean
_RELEASE_WAIT_S = 1.0  # the longest a rejected entry waits for this gateway's releases to land


# Admission estimates a request's prompt tokens from its body size, before anything parses or
# tokenizes it: one token per 4 bytes, the usual average of BPE tokenizers on English text. The
# JSON framing and field names count as prompt, which errs towards rejecting; text that
# tokenizes densely (code, CJK: 1-3 bytes per token) is underestimated.
BYTES_PER_TOKEN = 4


def estimate_prompt_tokens(num_body_bytes: int) -> int:
    return math.ceil(num_body_bytes / BYTES_PER_TOKEN)


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
    lease: str
    tokens: int
    entered_at: float
    engine: str | None = None
    granted_at: float | None = None
    forwarded: bool = False  # its engine call was made (Admission.forward)
    released: bool = False
    prefer: str | None = None  # its cache key's engine (place): granted there when it has a slot
    _granted: asyncio.Future[str] | None = field(default=None, repr=False)

    @property
    def queue_wait_s(self) -> float:
        return 0.0 if self.granted_at is None else self.granted_at - self.entered_at


class Admission:
    def __init__(self, ledger: Ledger, engines: Iterable[str] = (), *,
                 no_engine_retry_s: float = 2.0, prior_duration_s: float = 1.0,
                 initially_ready: bool = True, poll_s: float = 0.05,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ledger = ledger
        self.limits = ledger.limits
        self._ready = dict.fromkeys(engines, initially_ready)
        self._inflight = dict.fromkeys(self._ready, 0)  # this gateway's granted tickets
        self._unforwarded: dict[str, int] = {}  # granted, engine call not yet made
        self._waiting: OrderedDict[int, Ticket] = OrderedDict()
        self._ids = itertools.count()
        self._lease_prefix = uuid.uuid4().hex[:12]  # this gateway's leases in a shared ledger
        self._clock = clock
        self._poll_s = poll_s
        self._no_engine_retry_s = no_engine_retry_s
        # Exponentially weighted mean of how long a granted request holds its slot; the prior
        # only stands until the first request completes.
        self._mean_duration_s = prior_duration_s
        self.num_completed = 0
        self.draining = False
        self._shared_waiting = 0  # the queue length the ledger last reported (all gateways)
        self._entering = 0  # enter() calls waiting for the ledger's answer (Redis)
        self._wakeup = asyncio.Event()
        self._dispatcher: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    # -- figures -------------------------------------------------------------------------------

    @property
    def num_inflight(self) -> int:
        return sum(self._inflight.values())

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def load(self, engine: str) -> int:
        """Requests this gateway runs at `engine` now."""
        return self._inflight.get(engine, 0)

    @property
    def engines(self) -> list[str]:
        return list(self._ready)

    @property
    def ready_engines(self) -> list[str]:
        return [e for e, ready in self._ready.items() if ready]

    @property
    def capacity(self) -> int:
        return self.limits.max_inflight * len(self.ready_engines)

    @property
    def mean_duration_s(self) -> float:
        return self._mean_duration_s

    def retry_after_s(self) -> int:
        """Seconds until a new request would likely get a slot.

        The engines drain `capacity / mean_duration_s` requests per second; a newcomer waits for
        everyone queued ahead of it plus itself to drain. Entries still at the ledger count
        as queued beyond the free slots (a burst's tail is refused before its head is queued)."""
        if not self.capacity:
            return max(1, math.ceil(self._no_engine_retry_s))
        drain_per_s = self.capacity / self._mean_duration_s
        free = max(0, self.capacity - self.num_inflight)
        ahead = max(self.num_waiting + max(0, self._entering - free),
                    self._shared_waiting if self.ledger.mode == "redis" else 0)
        wait_s = (ahead + 1) / drain_per_s
        return min(_MAX_RETRY_AFTER_S, max(1, math.ceil(wait_s)))

    # -- engines -------------------------------------------------------------------------------

    def set_ready(self, engine: str, ready: bool) -> None:
        if self._ready.get(engine) == ready:
            return
        self._ready[engine] = ready
        self._inflight.setdefault(engine, 0)
        if ready:
            self._wake()
        elif not self.capacity:
            # Nobody can serve the queue: tell waiters now instead of at their deadline.
            for ticket in list(self._waiting.values()):
                self._drop(ticket, self._no_engine())

    def remove_engine(self, engine: str) -> None:
        """An engine left the registry: no new work goes there (running work finishes)."""
        self.set_ready(engine, False)
        if not self._inflight.get(engine):
            self._ready.pop(engine, None)
            self._inflight.pop(engine, None)
            self._unforwarded.pop(engine, None)

    # -- draining ------------------------------------------------------------------------------

    def drain(self) -> None:
        """Refuse new requests (503 draining); queued and running ones carry on."""
        self.draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is queued or running here; False if time ran out."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        """Stop the dispatcher and pending ledger releases (at shutdown)."""
        tasks = [t for t in (self._dispatcher, *self._background) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- the request path ----------------------------------------------------------------------

    def refusal(self, tokens: int = 0) -> Rejected | None:
        """The rejection enter() would raise, when this gateway can tell on its own: it is
        draining, no engine is ready, or its own leases already fill the limits (so every
        gateway's together do too). None: only the ledger can tell. Synchronous and cheap: a
        burst's rejections are answered from it before anything else is done for them."""
        if self.draining:
            return Rejected(DRAINING, max(1, math.ceil(self._no_engine_retry_s)),
                            "the gateway is shutting down; another replica can take the request")
        engines = self.ready_engines
        if not engines:
            return self._no_engine()
        # (while a release of this gateway's is still on its way to the ledger, the counts
        # here may hold a slot already given back: then enter() waits for it)
        if self.ledger.refuses(engines, tokens, self._entering) and not self._background:
            return self._queue_full(self.num_waiting + self._entering, tokens)
        return None

    async def enter(self, tokens: int = 0) -> Ticket:
        """Grant, queue or reject; never waits for a slot. Raises Rejected."""
        if (refused := self.refusal(tokens)) is not None:
            raise refused
        engines = self.ready_engines
        ticket_id = next(self._ids)
        ticket = Ticket(ticket_id, f"{self._lease_prefix}:{ticket_id}", tokens, self._clock())
        self._entering += 1  # until the ledger answers, it counts against the limits here
        try:
            entered = await self.ledger.enter(ticket.lease, engines, tokens)
            if entered.rejected and self._background:
                # A release runs after its response is written, so a client's next request can
                # reach the ledger first and find its own slot still taken: let this gateway's
                # releases land, then ask once more.
                await asyncio.wait(set(self._background), timeout=_RELEASE_WAIT_S)
                entered = await self.ledger.enter(ticket.lease, engines, tokens)
        finally:
            self._entering -= 1
        self._shared_waiting = entered.num_waiting
        if entered.engine is not None:
            self._grant(ticket, entered.engine)
        elif entered.queued:
            ticket._granted = asyncio.get_running_loop().create_future()
            self._waiting[ticket.ticket_id] = ticket
            self._idle.clear()
            self._wake()
        else:
            raise self._queue_full(entered.num_waiting, tokens)
        return ticket

    async def acquire(self, ticket: Ticket, timeout_s: float | None = None) -> str:
        """Wait for the ticket's engine slot. Leaving (cancel, timeout) gives up the place."""
        if ticket.engine is not None:
            return ticket.engine
        assert ticket._granted is not None
        if ticket._granted.done():  # granted or dropped while the request was still being read
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

    async def reestimate(self, ticket: Ticket, tokens: int) -> None:
        """The ticket's prompt is `tokens` after all (it was estimated from its body before the
        body was read). A ticket still queued counts them against the queued tokens; where
        they do not fit, it leaves the queue and Rejected (429) is raised."""
        if tokens <= ticket.tokens or ticket.released:
            return
        ticket.tokens = tokens
        if ticket.engine is not None or ticket.ticket_id not in self._waiting:
            return
        if await self.ledger.requeue(ticket.lease, tokens):
            return
        self.release(ticket)
        raise self._queue_full(self._shared_waiting if self.ledger.mode == "redis"
                               else self.num_waiting, tokens)

    async def place(self, ticket: Ticket, key: str | None) -> None:
        """Steer the ticket to its cache key's engine (`key_engine`), where its prompt's
        prefix is most likely already held: a granted ticket moves there if that engine has a
        slot (else it stays: load wins over the hint), a queued one is granted there first.
        With one engine ready, or no key, nothing changes."""
        engines = self.ready_engines
        if key is None or len(engines) < 2 or ticket.released:
            return
        ticket.prefer = target = key_engine(key, engines)
        source = ticket.engine
        if source is None or source == target or ticket.forwarded:
            return
        # Shielded: once the ledger is asked, the move's bookkeeping lands even when the
        # request is cancelled meanwhile (its release then frees the lease where it went).
        await asyncio.shield(self._move(ticket, source, target))

    async def _move(self, ticket: Ticket, source: str, target: str) -> None:
        try:
            moved = await self.ledger.move(ticket.lease, source, target)
        except Exception:
            log.exception("moving lease %s to its cache key's engine failed; it stays at %s",
                          ticket.lease, source)
            return
        if not moved:
            return
        if ticket.released:  # released at the source meanwhile: free it where it went
            self._ledger_release(ticket.lease, target)
            return
        for counts in (self._inflight, self._unforwarded):
            counts[source] -= 1
            counts[target] = counts.get(target, 0) + 1
        ticket.engine = target
        self._wake()  # the source's slot is free for a waiter

    def forward(self, ticket: Ticket) -> int:
        """The granted ticket's engine call is being made; returns how many requests this
        gateway has taken in for the same engine and forwards after it (granted ones, and
        those whose admission is still being decided when that engine is the only one ready):
        the engine's GenerateRequest.following."""
        assert ticket.engine is not None
        if not ticket.forwarded:
            ticket.forwarded = True
            self._unforwarded[ticket.engine] -= 1
        following = self._unforwarded[ticket.engine]
        if self.ready_engines == [ticket.engine]:
            following += self._entering
        return following

    def release(self, ticket: Ticket, *, observed: bool = False) -> None:
        """End the ticket (idempotent). `observed`: its duration feeds Retry-After."""
        if ticket.released:
            return
        ticket.released = True
        self._waiting.pop(ticket.ticket_id, None)
        if ticket._granted is not None and not ticket._granted.done():
            ticket._granted.cancel()
        if ticket.engine is not None:
            self._inflight[ticket.engine] -= 1
            if not ticket.forwarded:
                self._unforwarded[ticket.engine] -= 1
            assert self._inflight[ticket.engine] >= 0
            if observed and ticket.granted_at is not None:
                duration_s = max(self._clock() - ticket.granted_at, 1e-3)
                weight = 1.0 if self.num_completed == 0 else _EWMA_WEIGHT  # the prior yields
                self._mean_duration_s += weight * (duration_s - self._mean_duration_s)
                self.num_completed += 1
        self._ledger_release(ticket.lease, ticket.engine)
        self._check_idle()

    # -- internals -----------------------------------------------------------------------------

    def _grant(self, ticket: Ticket, engine: str) -> None:
        self._inflight[engine] = self._inflight.get(engine, 0) + 1
        self._unforwarded[engine] = self._unforwarded.get(engine, 0) + 1
        ticket.engine = engine
        ticket.granted_at = self._clock()
        self._idle.clear()

    def _wake(self) -> None:
        self._wakeup.set()
        if self._waiting and (self._dispatcher is None or self._dispatcher.done()):
            self._dispatcher = asyncio.get_running_loop().create_task(self._dispatch())

    async def _dispatch(self) -> None:
        """Grant queued tickets oldest first while the ledger has slots."""
        while self._waiting:
            self._wakeup.clear()
            for ticket in list(self._waiting.values()):
                engines = self.ready_engines
                if not engines:
                    break
                try:
                    engine = await self.ledger.grant_queued(ticket.lease, engines, ticket.prefer)
                except Exception:
                    log.exception("granting a queued request failed; retrying")
                    break
                if engine is None:
                    break
                if ticket.released:  # left (or dropped) while the ledger answered: hand it back
                    self._ledger_release(ticket.lease, engine)
                    continue
                self._waiting.pop(ticket.ticket_id, None)
                self._grant(ticket, engine)
                assert ticket._granted is not None
                ticket._granted.set_result(engine)
            if not self._waiting:
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._poll_s):
                    await self._wakeup.wait()

    def _ledger_release(self, lease: str, engine: str | None) -> None:
        task = asyncio.get_running_loop().create_task(self._release_then_wake(lease, engine))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release_then_wake(self, lease: str, engine: str | None) -> None:
        try:
            await self.ledger.release(lease, engine)
        except Exception:
            log.exception("releasing lease %s failed", lease)
        self._wake()

    def _drop(self, ticket: Ticket, error: Rejected) -> None:
        self._waiting.pop(ticket.ticket_id, None)
        ticket.released = True
        if ticket._granted is not None and not ticket._granted.done():
            ticket._granted.set_exception(error)
        self._ledger_release(ticket.lease, None)
        self._check_idle()

    def _check_idle(self) -> None:
        if not self._waiting and not self.num_inflight:
            self._idle.set()

    def _queue_full(self, num_waiting: int, tokens: int) -> Rejected:
        lim = self.limits
        return Rejected(QUEUE_FULL, self.retry_after_s(),
                        f"{self.num_inflight} requests running here and {num_waiting} queued "
                        f"(limits {lim.max_inflight} per engine, queue {lim.max_queue} requests "
                        f"/ {lim.max_queued_tokens} prompt tokens; this one ~{tokens})")

    def _no_engine(self) -> Rejected:
        return Rejected(NO_ENGINE, self.retry_after_s(),
                        "no engine is ready; the gateway retries them every few seconds")


def key_engine(key: str, engines: Iterable[str]) -> str:
    """The engine a cache key belongs to: rendezvous hashing, so every gateway replica picks the
    same one with no shared state, and an engine that leaves or joins moves only its own keys."""
    return max(engines, key=lambda engine: hashlib.blake2b(
        f"{key}\0{engine}".encode(), digest_size=8).digest())


class RejectionLog:
    """Admission's rejections in the log: the first of a window in full, the rest of the
    window as one line of counts by reason. Under a burst one line per rejection would cost
    more than the answers (and bury the log)."""

    def __init__(self, window_s: float = 1.0) -> None:
        self.window_s = window_s
        self._counts: dict[str, int] = {}
        self._level = logging.INFO  # WARNING once a 503 (no engine, draining) is counted
        self._open = False

    def add(self, where: str, exc: Rejected, status: int) -> None:
        level = logging.WARNING if status >= 500 else logging.INFO
        if not self._open:
            self._open = True
            log.log(level, "%s: %s -> %d", where, exc, status)
            asyncio.get_running_loop().call_later(self.window_s, self._close)
            return
        self._counts[exc.reason] = self._counts.get(exc.reason, 0) + 1
        self._level = max(self._level, level)

    def _close(self) -> None:
        self._open = False
        if self._counts:
            log.log(self._level, "%d more requests rejected in the last %.1f s: %s",
                    sum(self._counts.values()), self.window_s,
                    ", ".join(f"{n} {reason}" for reason, n in sorted(self._counts.items())))
            self._counts, self._level = {}, logging.INFO
