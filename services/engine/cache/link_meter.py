"""LinkMeter: the expert cache's host -> device copies — how many, how many bytes, and how long
the link was busy with them, for the cache manager's link bandwidth figure.

On CPU a copy is a synchronous memcpy timed with the wall clock. On CUDA copies run on the copy
stream: a pair of timing events around each gives its duration once it is done, read when the
totals are (no synchronisation on the copy path). The engine's loop thread writes; the reporter
reads `totals()` from another thread, hence the lock.
"""

from __future__ import annotations

import collections
import threading
from typing import Protocol

MAX_PENDING = 1024  # resolve finished CUDA copies on the write path beyond this many


class TimingEvent(Protocol):  # torch.cuda.Event(enable_timing=True)
    def query(self) -> bool: ...
    def elapsed_time(self, end: TimingEvent) -> float: ...  # milliseconds


class LinkMeter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._copies = 0
        self._bytes = 0
        self._busy_s = 0.0
        self._pending: collections.deque[tuple[TimingEvent, TimingEvent]] = collections.deque()

    def add(self, num_bytes: int, seconds: float) -> None:
        """A finished copy (CPU)."""
        with self._lock:
            self._copies += 1
            self._bytes += num_bytes
            self._busy_s += seconds

    def add_timed(self, num_bytes: int, start: TimingEvent, end: TimingEvent) -> None:
        """A copy enqueued between two timing events (CUDA); its time counts once it is done."""
        with self._lock:
            self._copies += 1
            self._bytes += num_bytes
            self._pending.append((start, end))
            if len(self._pending) > MAX_PENDING:
                self._resolve()

    def totals(self) -> tuple[int, int, float]:
        """(copies, bytes, busy seconds of the copies done) since the start."""
        with self._lock:
            self._resolve()
            return self._copies, self._bytes, self._busy_s

    def _resolve(self) -> None:
        while self._pending and self._pending[0][1].query():
            start, end = self._pending.popleft()
            self._busy_s += start.elapsed_time(end) / 1e3
