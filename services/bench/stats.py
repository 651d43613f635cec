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
