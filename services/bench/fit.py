"""`strata plan fit`: bench result JSONs -> a stored cost model with its error.

Points are single-stream decode requests (the `short_decode` case of `bench run`, concurrency 1
of `bench sweep`): the engine's per-request hit rate and decode tok/s, at the slot count the
engine reported. The fit is decode seconds per token against the miss rate (planner.CostModel),
or against the cache work per decode lookup when every result carries the engine's decode
counters over its requests (`decode_counters`: lookups, hits, demand_fills, prefetch_fills, as the
accuracy script records them): its slot fills for an engine on the CPU, where a miss is read in
place at the speed of a hit, its misses + slot fills elsewhere (planner.fit_driver).

The line is a median regression (least absolute deviations) of s/token: a shared machine adds a
heavy tail of slow requests that would pull a least-squares line, and the planner's figures are
compared with medians. The cost is kept only when the data show it: a positive slope whose 95%
bootstrap interval excludes 0, with a positive intercept. Otherwise (on a CPU a miss costs about
what a hit costs, so the slope is noise that explodes when extrapolated) the model falls back to
a constant: the median decode s/token of the points, every per-token overhead included, and says
why.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

from services.bench.planner import (
    CONSTANT,
    FILL,
    LINEAR,
    MISS,
    WORK,
    CostModel,
    cache_work,
    fit_driver,
)
from services.bench.stats import bootstrap_slope_interval, fit_median_line, median


def fit_points(result: dict, source: str = "") -> list[dict]:
    """(slots, hit rate, decode tok/s) of every single-stream decode request in one result."""
    engine = result.get("engine") or {}
    counters = result.get("decode_counters") or {}
    work = (cache_work(counters["lookups"], counters["hits"], counters["demand_fills"],
                       counters["prefetch_fills"])
            if counters.get("lookups") and {"demand_fills", "prefetch_fills"} <= set(counters)
            else None)
    outcomes: list[dict] = []
    for case in result.get("cases", []):
        if case.get("name") == "short_decode":
            outcomes += case.get("requests", [])
    for level in result.get("levels", []):
        if level.get("concurrency") == 1:
            outcomes += level.get("requests", [])
    points = []
    for o in outcomes:
        if o.get("ok") and o.get("hit_rate") is not None and (o.get("decode_tok_s") or 0) > 0:
            points.append({"source": source, "slots": engine.get("slots"),
                           "device_memory_bytes": engine.get("device_memory_bytes"),
                           "hit_rate": o["hit_rate"], "decode_tok_s": o["decode_tok_s"],
                           "work": work, "device": engine.get("device")})
    return points


def fit_cost_model(points: list[dict]) -> tuple[CostModel, dict]:
    """Median regression of s/token on the miss rate (or cache work), or a constant when that
    cost is not significant; returns the model and its error report (which says which, why)."""
    if not points:
        raise ValueError("no single-stream decode requests with engine figures in the results")
    devices = {p.get("device") for p in points}
    driver = fit_driver(devices.pop() if len(devices) == 1 else None,
                        all(p.get("work") is not None for p in points))
    probe = CostModel(0.0, 1.0, 0.0, 1.0, LINEAR, driver)
    x = [probe.driver_value(p["hit_rate"], p.get("work")) for p in points]
    s_per_token = [1.0 / p["decode_tok_s"] for p in points]
    line = fit_median_line(x, s_per_token)
    interval = bootstrap_slope_interval(x, s_per_token)
    fallback = _fallback_reason(line.slope, line.intercept, interval)
    if fallback is None:
        model = CostModel(line.intercept, line.slope, min(x), max(x), LINEAR, driver)
    else:
        model = CostModel(median(s_per_token) or 0.0, 0.0, min(x), max(x), CONSTANT, driver)
    rel = [model.decode_tok_s(p["hit_rate"], p.get("work")) / p["decode_tok_s"] - 1.0
           for p in points]
    groups = []
    for slots in sorted({p["slots"] for p in points}, key=lambda s: (s is None, s)):
        group = [p for p in points if p["slots"] == slots]
        hit = median([p["hit_rate"] for p in group])
        work = group[0].get("work")
        measured = median([p["decode_tok_s"] for p in group])
        predicted = model.decode_tok_s(hit, work)
        groups.append({"slots": slots, "num_requests": len(group), "hit_rate_p50": hit,
                       "work": probe.driver_value(hit, work), "decode_tok_s_p50": measured,
                       "predicted_tok_s": predicted,
                       "rel_error": predicted / measured - 1.0})
    linear = CostModel(line.intercept, line.slope, min(x), max(x), LINEAR, driver)
    linear_rel = [linear.decode_tok_s(p["hit_rate"], p.get("work")) / p["decode_tok_s"] - 1.0
                  for p in points]
    error = {"num_points": len(points), "model": model.form, "driver": driver,
             "rms_rel_error": _rms(rel), "max_abs_rel_error": max(abs(r) for r in rel),
             "by_slots": groups,
             "miss_cost": {"per_miss_s": line.slope, "base_s": line.intercept,
                           "se_s": interval[0] if interval else None,
                           "ci95_s": list(interval[1:]) if interval else None,
                           "significant": fallback is None,
                           "linear_rms_rel_error": _rms(linear_rel)},
             "fallback": fallback}
    return model, error


def _fallback_reason(slope: float, intercept: float,
                     interval: tuple[float, float, float] | None) -> str | None:
    """Why the fitted cost (slope) cannot be used, as the end of a sentence; None: it can."""
    if interval is None:
        return "cannot be estimated (too few points, or one value of the driver)"
    _, lo, hi = interval
    ci = f"95% CI {lo * 1e3:+.3f}..{hi * 1e3:+.3f} ms"
    if slope <= 0:
        return f"is not positive: {slope * 1e3:+.3f} ms ({ci})"
    if lo <= 0:
        return f"is not significant: {slope * 1e3:+.3f} ms ({ci} includes 0)"
    if intercept <= 0:
        return (f"leaves {intercept * 1e3:+.3f} ms per token at no cache cost (not physical)")
    return None


DRIVERS = {MISS: "(1 - hit_rate)", WORK: "cache_work  [(misses + slot fills) per decode lookup]",
           FILL: "fill_rate  [slot fills per decode lookup]"}
UNITS = {MISS: "unit miss rate",
         WORK: "unit of cache work ((misses + slot fills) per decode lookup)",
         FILL: "slot fill per decode lookup"}


def _rms(values: list[float]) -> float:
    return float(sum(r * r for r in values) / len(values)) ** 0.5


def describe(model: CostModel, error: dict) -> str:
    """The fit's basis in one line: which model and why."""
    cost = error["miss_cost"]
    unit = UNITS[model.driver]
    if model.form == LINEAR:
        lo, hi = cost["ci95_s"]
        return (f"linear: {model.per_miss_s * 1e3:.3f} ms per token per {unit} "
                f"(95% CI {lo * 1e3:.3f}..{hi * 1e3:.3f} ms)")
    return (f"constant (median s/token, overheads included): the cost per {unit} "
            f"{error['fallback']}; decode tok/s taken as independent of the cache over the range "
            "seen")


def fit_results(paths: Iterable[Path]) -> dict:
    """The stored fit: cost model, its error, the points, and the measured hit-rate points."""
    points: list[dict] = []
    hardware = None
    for path in paths:
        result = json.loads(Path(path).read_text())
        points += fit_points(result, str(path))
        engine = result.get("engine") or {}
        if hardware is None and engine.get("slot_bytes"):
            hardware = {k: engine.get(k) for k in
                        ("model", "slot_bytes", "total_pairs", "reserved_bytes",
                         "weight_bytes", "kv_bytes")}
    model, error = fit_cost_model(points)
    hit_points = [[g["slots"], g["hit_rate_p50"]] for g in error["by_slots"]
                  if g["slots"] is not None]
    form = (f"s_per_token = base_s + per_miss_s * {DRIVERS[model.driver]}"
            if model.form == LINEAR else "s_per_token = base_s")
    points = [{**p, "work": None if p["work"] is None else asdict(p["work"])} for p in points]
    return {"kind": "strata-plan-fit", "version": 2,
            "cost_model": {"form": form, "model": model.form, "driver": model.driver,
                           "basis": describe(model, error),
                           "base_s": model.base_s, "per_miss_s": model.per_miss_s,
                           "miss_lo": model.miss_lo, "miss_hi": model.miss_hi},
            "error": error, "hardware": hardware, "hit_points": hit_points, "points": points}
