"""The circuit breaker's states on a fake clock."""

from services.gateway.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


def test_opens_after_threshold_then_half_open_then_closes():
    clock = Clock()
    breaker = CircuitBreaker(threshold=3, cooldown_s=2.0, max_cooldown_s=5.0, clock=clock)
    assert not breaker.record_failure() and not breaker.record_failure()
    assert breaker.state == CLOSED and breaker.allows()
    breaker.record_success()  # consecutive failures only
    assert [breaker.record_failure() for _ in range(3)] == [False, False, True]
    assert breaker.state == OPEN and not breaker.allows()
    clock.now += 2.0
    assert breaker.state == HALF_OPEN and breaker.allows()
    assert breaker.record_failure()  # the trial failed: open again, longer
    assert breaker.state == OPEN and breaker.cooldown_s == 4.0
    clock.now += 4.0
    assert breaker.record_failure() and breaker.cooldown_s == 5.0  # capped
    clock.now += 5.0
    breaker.record_success()
    assert breaker.state == CLOSED and breaker.cooldown_s == 2.0 and breaker.failures == 0
