"""The SSE writer's batches: what piled up while the last write was in flight goes out merged."""

from services.gateway.engine_client import Delta, Finished, RequestStats
from services.gateway.handlers import _merged


def test_each_choices_deltas_merge_and_keep_their_order_around_finished():
    done = Finished("stop", RequestStats())
    batch = [(0, Delta("a", 1)), (1, Delta("x", 1)), (0, Delta("b", 2)), (0, done),
             (1, Delta("y", 1)), (1, None)]
    assert _merged(batch) == [(0, Delta("ab", 3)), (0, done), (1, Delta("xy", 2)), (1, None)]
    assert _merged([(0, Delta("a", 1))]) == [(0, Delta("a", 1))]
