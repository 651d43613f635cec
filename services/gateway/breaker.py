"""A circuit breaker per engine: stop sending work to an engine that keeps failing.

    closed ──threshold consecutive failures──> open ──cooldown_s──> half-open
      ^                                                                  │
      └──────────── a success (probe or request) ────────────────────────┘
                    a failure in half-open opens it again, with the cooldown doubled (capped)

Pure logic with an injectable clock; the engine pool records outcomes and asks `allows()`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class CircuitBreaker:
    def __init__(self, threshold: int = 3, cooldown_s: float = 5.0, max_cooldown_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        assert threshold >= 1 and 0 < cooldown_s <= max_cooldown_s
        self.threshold = threshold
        self.base_cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self._clock = clock
        self.failures = 0  # consecutive
        self.cooldown_s = cooldown_s
        self._opened_at: float | None = None

    @property
    def state(self) -> str:
        if self._opened_at is None:
            return CLOSED
        return HALF_OPEN if self._clock() - self._opened_at >= self.cooldown_s else OPEN

    def allows(self) -> bool:
        """May work (a probe or a request) go to the engine now?"""
        return self.state != OPEN

    def record_success(self) -> None:
        self.failures = 0
        self._opened_at = None
        self.cooldown_s = self.base_cooldown_s

    def record_failure(self) -> bool:
        """Count one failure; True when this failure opened (or re-opened) the breaker."""
        state = self.state
        self.failures += 1
        if state == HALF_OPEN:
            self.cooldown_s = min(self.cooldown_s * 2, self.max_cooldown_s)
            self._opened_at = self._clock()
            return True
        if state == CLOSED and self.failures >= self.threshold:
            self._opened_at = self._clock()
            return True
        return False
