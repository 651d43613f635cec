"""Where a CPU decode step's time goes: each kernel call timed, the rest is Python.

    python scripts/decode_profile.py [--model DIR] [--dtype auto|bf16|fp32] [--batch B]
                                     [--gen-tokens G] [--rounds R]

Loads the model like `strata bench engine` (every expert cached, prefetch off), wraps the CPU
kernels' ctypes calls (routed experts, the fused attention half, linear products) with a timer and
prints, per round of G - 1 decode steps, ms per step in each kernel and outside them (Python:
route(), the runner's and the forward's set-up).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from services.bench.engine_bench import prompts, run_strata
from services.engine.model.dtypes import DTYPES
from services.engine.runner import ModelRunner

KERNELS = ("decode_step", "moe", "linear", "linear_blocks", "linear_fp8", "decode_layer",
           "rms_norm", "router", "decode_attention")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=Path("/tmp/bench-moe"))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", choices=DTYPES, default="auto")
    args = p.parse_args()
    runner = ModelRunner(args.model, device="cpu", device_memory_bytes=2**50, reserved_bytes=0,
                         prefetch=False, dtype=args.dtype, cpu_kernels="on")
    cpu = runner.backend.cpu
    runner.fill_cache(runner.layer_order_pairs(), source="layer order")
    batch_prompts = prompts(args.batch, 32)
    run_strata(runner, batch_prompts, 8)  # warm-up
    spent: dict[str, float] = {}
    for name in KERNELS:
        fn = getattr(cpu, name)

        def timed(*a, _fn=fn, _name=name, **kw):
            t0 = time.perf_counter()
            out = _fn(*a, **kw)
            spent[_name] = spent.get(_name, 0.0) + time.perf_counter() - t0
            return out

        setattr(cpu, name, timed)
    decode_spent: dict[str, float] = {}
    step = runner.step

    def decode_only(chunks, *rest):  # kernel time of decode steps only (not the prefill step)
        before = dict(spent)
        out = step(chunks, *rest)
        if not any(c.prefill for c in chunks):
            for n, v in spent.items():
                decode_spent[n] = decode_spent.get(n, 0.0) + v - before.get(n, 0.0)
        return out

    runner.step = decode_only
    steps = args.gen_tokens - 1
    for _ in range(args.rounds):
        decode_spent.clear()
        _, decode_s, _, _ = run_strata(runner, batch_prompts, args.gen_tokens)
        kernel_s = sum(decode_spent.values())
        parts = ", ".join(f"{n} {v / steps * 1e3:.2f}" for n, v in decode_spent.items() if v)
        print(f"decode {args.batch * steps / decode_s:.1f} tok/s, {decode_s / steps * 1e3:.2f} "
              f"ms/step: kernels {kernel_s / steps * 1e3:.2f} ms ({parts}); other "
              f"{(decode_s - kernel_s) / steps * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
