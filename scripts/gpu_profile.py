"""Where a CUDA decode step's time goes: torch.profiler over decode steps of the bench model.

    python scripts/gpu_profile.py [--model DIR] [--batch B] [--steps N] [--coverage C]
                                  [--dtype auto|bf16|fp32]

Loads the model like `strata bench engine --device cuda` (cache at --coverage, filled in layer
order, prefetch off), runs a warm-up, then profiles N decode steps and prints: wall ms per step,
device-busy ms per step (sum of kernel and copy times), kernel launches per step, and the top
operators by device time and by host time.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from services.bench.engine_bench import prompts, run_strata
from services.engine.model.checkpoint import load_model_config
from services.engine.model.dtypes import DTYPES
from services.engine.runner import ModelRunner


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=Path("/tmp/bench-moe"))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--coverage", type=float, default=1.0)
    p.add_argument("--dtype", choices=DTYPES, default="auto")
    args = p.parse_args()
    config = load_model_config(args.model)
    runner = ModelRunner(args.model, device="cuda", reserved_bytes=0, prefetch=False,
                         cache_slots=round(args.coverage * config.total_pairs),
                         graph_batches=(args.batch,), dtype=args.dtype)
    runner.fill_cache(runner.layer_order_pairs(), source="layer order")
    batch_prompts = prompts(args.batch, 32)
    run_strata(runner, batch_prompts, 8)  # warm-up: Triton compiles, allocator settles
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    run_strata(runner, batch_prompts, args.steps + 1)
    wall = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_strata(runner, batch_prompts, args.steps + 1)
        torch.cuda.synchronize()
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events)
    launches = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    steps = args.steps + 1  # the prefill step counts as one
    print(f"wall {wall / steps * 1e3:.2f} ms/step unprofiled ({args.batch * args.steps / wall:.0f}"
          f" tok/s incl. prefill); device busy {device_us / steps / 1e3:.3f} ms/step; "
          f"{launches / steps:.0f} device ops/step")
    print(events.table(sort_by="self_device_time_total", row_limit=15))
    print(events.table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
