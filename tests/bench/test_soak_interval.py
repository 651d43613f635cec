"""The soak's TTFT drift interval (services/bench/load.ttft_drift_interval) on constructed
halves: it holds 0 when nothing drifts, lies above the limit for a real drift, and widens when
a half's requests came in slow and fast spells of the host; the verdict fails a drift only
when the wall clock and the host's pace both show it."""

from __future__ import annotations

import numpy as np

from services.bench.client import Outcome
from services.bench.load import SOAK_LIMITS, soak_verdict, ttft_drift_interval


def half(ttft_s: np.ndarray, itl_s: np.ndarray) -> list[Outcome]:
    return [Outcome(True, 200, ttft_s=float(t), client_decode_tok_s=float(1 / i))
            for t, i in zip(ttft_s, itl_s, strict=True)]


def noisy(rng: np.random.Generator, n: int, ttft_s: float = 0.020, itl_s: float = 0.002
          ) -> tuple[np.ndarray, np.ndarray]:
    return ttft_s * rng.lognormal(0, 0.15, n), itl_s * rng.lognormal(0, 0.05, n)


def paced_drift_interval(first, second, **kw):
    return ttft_drift_interval(first, second, at_host_pace=True, **kw)


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


def verdict(first: list[Outcome], second: list[Outcome]) -> dict:
    def p50_ratio(values) -> float:
        return float(np.median(values[1]) / np.median(values[0]) - 1.0)

    ttft = [np.array([o.ttft_s for o in h]) for h in (first, second)]
    itl = [np.array([1 / o.client_decode_tok_s for o in h]) for h in (first, second)]
    result = {"num_requests": 1, "num_success": 1, "ttft_drift": p50_ratio(ttft),
              "ttft_drift_95": ttft_drift_interval(first, second, at_host_pace=False),
              "ttft_drift_at_host_pace": p50_ratio([t / np.median(i)
                                                    for t, i in zip(ttft, itl, strict=True)]),
              "ttft_drift_at_host_pace_95": paced_drift_interval(first, second)}
    return soak_verdict(result, {}, None)["criteria"]["ttft_drift"]


def test_a_faster_host_under_steady_fixed_costs_is_no_drift():
    """The host's decode got 15% faster in the second half and TTFT stayed: dividing by the
    pace alone reads +18%, but a TTFT made of fixed costs need not follow the decode pace."""
    rng = np.random.default_rng(4)
    ttft, itl = noisy(rng, 600)
    check = verdict(half(*noisy(rng, 600)), half(ttft, itl * 0.85))
    assert check["ok"] and check["interval_95"][0] < 0 < check["interval_95"][1]


def test_a_drift_on_both_clocks_fails_the_verdict():
    rng = np.random.default_rng(5)
    ttft, itl = noisy(rng, 600)
    check = verdict(half(*noisy(rng, 600)), half(ttft * 1.25, itl))
    assert not check["ok"] and check["value"] > SOAK_LIMITS["ttft_drift"]


def test_a_slower_host_that_explains_the_ttft_growth_is_no_drift():
    rng = np.random.default_rng(6)
    ttft, itl = noisy(rng, 600)
    check = verdict(half(*noisy(rng, 600)), half(ttft * 1.25, itl * 1.25))
    assert check["ok"] and not check["shown_below_limit"]
