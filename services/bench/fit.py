"""`strata plan fit`: bench result JSONs -> a stored cost model with its error.

Points are single-stream decode requests (the `short_decode` case of `bench run`, concurrency 1
of `bench sweep`): the engine's per-request hit rate and decode tok/s, at the slot count the
engine reported. The fit is decode seconds per token against the miss rate (planner.CostModel).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from services.bench.planner import CostModel
from services.bench.stats import fit_linear, median


def fit_points(result: dict, source: str = "") -> list[dict]:
    """(slots, hit rate, decode tok/s) of every single-stream decode request in one result."""
    engine = result.get("engine") or {}
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
                           "hit_rate": o["hit_rate"], "decode_tok_s": o["decode_tok_s"]})
    return points


def fit_cost_model(points: list[dict]) -> tuple[CostModel, dict]:
    """Least squares of s/token on miss rate; returns the model and its error report."""
    if not points:
        raise ValueError("no single-stream decode requests with engine figures in the results")
    miss = [1.0 - p["hit_rate"] for p in points]
    line = fit_linear(miss, [1.0 / p["decode_tok_s"] for p in points])
    model = CostModel(line.intercept, line.slope, min(miss), max(miss))
    rel = [model.decode_tok_s(p["hit_rate"]) / p["decode_tok_s"] - 1.0 for p in points]
    groups = []
    for slots in sorted({p["slots"] for p in points}, key=lambda s: (s is None, s)):
        group = [p for p in points if p["slots"] == slots]
        hit = median([p["hit_rate"] for p in group])
        measured = median([p["decode_tok_s"] for p in group])
        predicted = model.decode_tok_s(hit)
        groups.append({"slots": slots, "num_requests": len(group), "hit_rate_p50": hit,
                       "decode_tok_s_p50": measured, "predicted_tok_s": predicted,
                       "rel_error": predicted / measured - 1.0})
    error = {"num_points": len(points),
             "rms_rel_error": float(sum(r * r for r in rel) / len(rel)) ** 0.5,
             "max_abs_rel_error": max(abs(r) for r in rel), "by_slots": groups}
    return model, error


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
                        ("model", "slot_bytes", "total_pairs", "reserved_bytes")}
    model, error = fit_cost_model(points)
    hit_points = [[g["slots"], g["hit_rate_p50"]] for g in error["by_slots"]
                  if g["slots"] is not None]
    return {"kind": "strata-plan-fit", "version": 1,
            "cost_model": {"form": "s_per_token = base_s + per_miss_s * (1 - hit_rate)",
                           "base_s": model.base_s, "per_miss_s": model.per_miss_s,
                           "miss_lo": model.miss_lo, "miss_hi": model.miss_hi},
            "error": error, "hardware": hardware, "hit_points": hit_points, "points": points}
