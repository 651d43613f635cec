"""A decode step's layers in one C call (every pair resident) against the same steps layer by
layer, interleaved in one process: two runners on one checkpoint, the second with the cache's
step_table turned off, their rounds alternating.

    python scripts/decode_table_ab.py MODEL [--batch B] [--gen-tokens G] [--rounds R]

Prints each side's decode tok/s per round, the medians and the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from services.bench.engine_bench import prompts, run_strata  # noqa: E402
from services.engine.runner import ModelRunner  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--gen-tokens", type=int, default=65)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    runners = []
    for one_call in (True, False):
        r = ModelRunner(a.model, device="cpu", device_memory_bytes=2**50, reserved_bytes=0,
                        prefetch=False, cpu_kernels="on")
        r.fill_cache(r.layer_order_pairs(), source="layer order")
        if not one_call:
            r.cache.step_table = lambda: None
        runners.append(r)
    batch_prompts = prompts(a.batch, 32)
    for r in runners:
        run_strata(r, batch_prompts, 8)  # warm-up
    rates: list[list[float]] = [[], []]
    for rnd in range(a.rounds):
        for i in (0, 1) if rnd % 2 == 0 else (1, 0):
            _, decode_s, _, _ = run_strata(runners[i], batch_prompts, a.gen_tokens)
            rates[i].append(a.batch * (a.gen_tokens - 1) / decode_s)
    for i, name in ((0, "one call"), (1, "layer by layer")):
        print(f"{name}: median {statistics.median(rates[i]):.1f} tok/s (rounds "
              + " ".join(f"{v:.0f}" for v in rates[i]) + ")")
    ratios = [x / y for x, y in zip(rates[0], rates[1], strict=True)]
    print(f"one call / layer by layer: {statistics.median(ratios):.2f}x (median of the rounds' "
          f"ratios, {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
