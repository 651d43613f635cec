"""The soak's TTFT drift interval (services/bench/load.paced_drift_interval) on constructed
halves: it holds 0 when nothing drifts, lies above the limit for a real drift, and widens when
a half's requests came in slow and fast spells of the host."""

from __future__ import annotations

import numpy as np

from services.bench.client import Outcome
from services.bench.load import SOAK_LIMITS, paced_drift_interval


def half(ttft_s: np.ndarray, itl_s: np.ndarray) -> list[Outcome]:
    return [Outcome(True, 200, ttft_s=float(t), client_decode_tok_s=float(1 / i))
            for t, i in zip(ttft_s, itl_s, strict=True)]


def noisy(rng: np.random.Generator, n: int, ttft_s: float = 0.020, itl_s: float = 0.002
          ) -> tuple[np.ndarray, np.ndarray]:
    return ttft_s * rng.lognormal(0, 0.15, n), itl_s * rng.lognormal(0, 0.05, n)


def test_no_drift_gives_an_interval_around_zero():
    rng = np.random.default_rng(1)
    low, high = paced_drift_interval(half(*noisy(rng, 600)), half(*noisy(rng, 600)))
    assert low < 0 < high and high - low < 0.1


def test_a_real_drift_is_shown_above_the_limit():
    rng = np.random.default_rng(2)
    ttft, itl = noisy(rng, 600)
    low, _ = paced_drift_interval(half(*noisy(rng, 600)), half(ttft * 1.2, itl))
    assert low > SOAK_LIMITS["ttft_drift"]


def test_a_half_in_slow_and_fast_spells_gets_a_wider_interval_than_one_of_steady_requests():
    rng = np.random.default_rng(3)
    first = half(*noisy(rng, 600))
    ttft, itl = noisy(rng, 600)
    spells = np.repeat([1.0, 1.3, 1.0, 1.3, 1.3, 1.0], 100)  # the host's neighbours: 6 spells
    steady = paced_drift_interval(first, half(ttft * rng.permutation(spells), itl))
    clustered = paced_drift_interval(first, half(ttft * spells, itl))
    assert clustered[1] - clustered[0] > 1.5 * (steady[1] - steady[0])
    # request by request (a run of one) the clustered half looked as certain as the steady
    one_by_one = paced_drift_interval(first, half(ttft * spells, itl), blocks=600)
    assert one_by_one[1] - one_by_one[0] < 1.5 * (steady[1] - steady[0])
