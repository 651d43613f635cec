"""Small statistics used by the benches and the planner (numpy only)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100, linear interpolation); None for no values."""
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def median(values: Sequence[float]) -> float | None:
    return percentile(values, 50)


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Pearson correlation; None when undefined (fewer than 2 points or a constant series)."""
    assert len(xs) == len(ys)
    if len(xs) < 2:
        return None
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    dx, dy = x - x.mean(), y - y.mean()
    denom = math.sqrt(float(dx @ dx) * float(dy @ dy))
    return float(dx @ dy) / denom if denom > 0 else None


@dataclass(frozen=True)
class LinearFit:
    """y = intercept + slope * x, least squares, with its in-sample error."""

    intercept: float
    slope: float
    num_points: int
    rms_error: float  # root mean square residual, in y's unit
    max_abs_error: float

    def __call__(self, x: float) -> float:
        return self.intercept + self.slope * x


def fit_linear(xs: Sequence[float], ys: Sequence[float]) -> LinearFit:
    """Least-squares line. One distinct x (or one point) gives a flat line through the mean."""
    assert len(xs) == len(ys) and len(xs) >= 1
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if np.ptp(x) == 0:
        intercept, slope = float(y.mean()), 0.0
    else:
        slope, intercept = (float(v) for v in np.polyfit(x, y, 1))
    residuals = y - (intercept + slope * x)
    return LinearFit(intercept, slope, len(x), float(np.sqrt(np.mean(residuals**2))),
                     float(np.max(np.abs(residuals))))


def median_interval(values: Sequence[float], resamples: int = 2000, seed: int = 0
                    ) -> tuple[float, float] | None:
    """95% bootstrap interval of the median (percentile method); None for no values."""
    if not len(values):
        return None
    v = np.asarray(values, dtype=float)
    picks = np.random.default_rng(seed).integers(0, len(v), (resamples, len(v)))
    medians = np.median(v[picks], axis=1)
    return float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))


def fit_median_line(xs: Sequence[float], ys: Sequence[float], iterations: int = 60) -> LinearFit:
    """Least absolute deviations line (median regression), by iteratively reweighted least
    squares from the least-squares line: robust to the heavy tail of slow outliers that a
    shared CPU adds, and consistent with comparing medians. Two distinct x give the line
    through the two groups' medians; one gives a flat line through the median."""
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    assert len(x) == len(y) and len(x) >= 1
    if np.ptp(x) == 0:
        intercept, slope = float(np.median(y)), 0.0
    else:
        groups = np.unique(x)
        if len(groups) == 2:
            lo, hi = (float(np.median(y[x == g])) for g in groups)
            slope = (hi - lo) / float(groups[1] - groups[0])
            intercept = lo - slope * float(groups[0])
        else:
            slope, intercept = (float(v) for v in np.polyfit(x, y, 1))
            scale = max(float(np.median(np.abs(y))), 1e-300) * 1e-9
            for _ in range(iterations):
                w = 1.0 / np.maximum(np.abs(y - (intercept + slope * x)), scale)  # [N]
                new_slope, new_intercept = (float(v) for v in np.polyfit(x, y, 1, w=np.sqrt(w)))
                done = abs(new_slope - slope) <= 1e-12 * (1 + abs(slope))
                slope, intercept = new_slope, new_intercept
                if done:
                    break
    residuals = y - (intercept + slope * x)
    return LinearFit(intercept, slope, len(x), float(np.sqrt(np.mean(residuals**2))),
                     float(np.max(np.abs(residuals))))


def bootstrap_slope_interval(xs: Sequence[float], ys: Sequence[float], resamples: int = 400,
                             seed: int = 0) -> tuple[float, float, float] | None:
    """(standard error, low, high): 95% bootstrap interval (percentile method, resampling
    points) of the median-regression slope; None with fewer than 3 points or one distinct x."""
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if len(x) < 3 or np.ptp(x) == 0:
        return None
    rng = np.random.default_rng(seed)
    slopes = []
    for _ in range(resamples):
        pick = rng.integers(0, len(x), len(x))
        if np.ptp(x[pick]) > 0:
            slopes.append(fit_median_line(x[pick], y[pick]).slope)
    if not slopes:
        return None
    s = np.asarray(slopes)
    return float(s.std(ddof=1)), float(np.percentile(s, 2.5)), float(np.percentile(s, 97.5))
