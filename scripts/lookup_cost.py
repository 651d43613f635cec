"""Host time of a step's expert-cache lookups, per MoE layer, at a cache coverage.

    python scripts/lookup_cost.py MODEL [--coverage 1.0 0.25] [--rows 1 8] [--steps 50]

A decode step that reads its experts by table (a CPU one-call step, a CUDA graph's replay)
makes its lookups after the forward, in Python (`ExpertCache.finish_table_step`: policy state,
hit counters, the fills of the misses the policy admits), so their time adds to every step's.
Loads MODEL on the CPU with `coverage` of its (layer, expert) pairs in cache slots (1.0: every
pair, filled in layer order), then times finish_table_step on random routings of `rows`
tokens (K distinct experts each) for `steps` steps: median microseconds per step and per layer,
and the fills per layer-step. On the CPU a fill is a host-to-host copy; on a GPU an
asynchronous copy and its events.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from services.engine.model.checkpoint import load_model_config
from services.engine.runner import ModelRunner


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--coverage", type=float, nargs="+", default=[1.0, 0.25])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=50)
    a = p.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    pairs = load_model_config(a.model).total_pairs
    for coverage in a.coverage:
        runner = ModelRunner(a.model, device="cpu", device_memory_bytes=2**50, reserved_bytes=0,
                             prefetch=False, cpu_kernels="on",
                             cache_slots=max(1, round(coverage * pairs)))
        if coverage >= 1.0:
            runner.fill_cache(runner.layer_order_pairs(), source="layer order")
        cache = runner.cache
        experts, k = runner.config.num_experts, runner.config.experts_per_token
        layers = list(runner.model.moe_layers)
        for rows in a.rows:
            times, fills = [], []
            for _ in range(a.steps):
                top = np.stack([np.stack([rng.choice(experts, k, replace=False)
                                          for _ in range(rows)]) for _ in layers])
                cache.begin_step(rows, False)
                filled = cache.link.totals()[0]
                t0 = time.perf_counter()
                cache.finish_table_step(layers, top.astype(np.int64))
                times.append(time.perf_counter() - t0)
                fills.append(cache.link.totals()[0] - filled)
            us = statistics.median(times) * 1e6
            print(f"coverage {coverage:.2f} ({cache.residency.num_resident}/{pairs} resident), "
                  f"{rows} rows: {us:.0f} us a step, {us / len(layers):.1f} us a layer, "
                  f"{statistics.mean(fills) / len(layers):.1f} fills a layer", flush=True)


if __name__ == "__main__":
    main()
