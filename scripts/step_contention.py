"""How much a decode step slows when another process shares the cores, at batch 1 and 8.

    PYTHONPATH=. python scripts/step_contention.py MODEL [--duties 0 0.1 0.25 0.5]
                                     [--period-ms 2] [--max-tokens 64] [--reps 4] [--threads 2]

On a small host the engine's cores are shared with the gateway, the cache manager, the engine's
own gRPC thread and (in a bench) the load client: a few tenths of a core in short bursts. This
loads MODEL into an in-process `Engine` (every pair cached, the C kernels on) and, for each duty
in turn (the levels interleaved, `--reps` times), starts a competing process that spins for
duty x period and sleeps the rest of each period, then runs 1 and then 8 concurrent
`ignore_eos` requests (scripts/engine_rate.py's `rate`). Prints, per duty, the median over reps
of: the runner's step time at batch 1 and at batch 8 (ModelRunner.step, wall), completion
tokens per second at 1 and 8 requests (TTFT included) and their ratio. Where the serving
path's c8/c1 goes (docs/benchmarks.md, "Where the sweep's eighth client goes").
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch
from engine_rate import rate  # scripts/ is this script's directory: its sys.path[0]

from services.bench.quant_bench import load_runner
from services.engine import runner as runner_module
from services.engine.core import Engine
from services.engine.sampling import SamplingConfig

BURNER = """
import sys, time
duty, period = float(sys.argv[1]), float(sys.argv[2])
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < duty * period:
        pass
    time.sleep(period * (1 - duty))
"""

step_times: list[tuple[int, float]] = []  # (rows, seconds) of each ModelRunner.step
_step = runner_module.ModelRunner.step


def _timed_step(self, work):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    out = _step(self, work)
    step_times.append((len(work), time.perf_counter() - t0))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--duties", type=float, nargs="+", default=[0.0, 0.1, 0.25, 0.5])
    p.add_argument("--period-ms", type=float, default=2.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    runner_module.ModelRunner.step = _timed_step  # type: ignore[method-assign]
    runner = load_runner(a.model, "auto", device="cpu", cpu_kernels="on")
    engine = Engine(runner, max_running=16)
    engine.start()
    greedy = SamplingConfig()
    rows: dict[float, list[tuple[float, float, float, float]]] = {d: [] for d in a.duties}
    try:
        rate(engine, 2, 8, "warm-up", greedy)
        for rep in range(a.reps):
            for duty in a.duties:
                burner = subprocess.Popen([sys.executable, "-c", BURNER, str(duty),
                                           str(a.period_ms / 1e3)]) if duty > 0 else None
                try:
                    time.sleep(0.05)
                    step_times.clear()
                    c1 = rate(engine, 1, a.max_tokens, f"r{rep}-d{duty}-c1", greedy)
                    c8 = rate(engine, 8, a.max_tokens, f"r{rep}-d{duty}-c8", greedy)
                finally:
                    if burner is not None:
                        burner.kill()
                        burner.wait()
                b1 = statistics.median(s for n, s in step_times if n == 1)
                b8 = statistics.median(s for n, s in step_times if n == 8)
                rows[duty].append((b1 * 1e3, b8 * 1e3, c1, c8))
                print(f"rep {rep + 1}/{a.reps}, competing duty {duty:.2f}: step b1 "
                      f"{b1 * 1e3:.3f} ms, b8 {b8 * 1e3:.3f} ms; {c1:.0f} / {c8:.0f} tok/s",
                      file=sys.stderr, flush=True)
    finally:
        engine.stop()
    print(f"| competing process (share of one core, {a.period_ms:g} ms period) | step batch 1 ms "
          "| step batch 8 ms | 1 request tok/s | 8 requests tok/s | c8/c1 |")
    print("|---|---|---|---|---|---|")
    for duty, reps in rows.items():
        med = [statistics.median(r[i] for r in reps) for i in range(4)]
        ratio = statistics.median(r[3] / r[2] for r in reps)
        print(f"| {duty:.0%} | {med[0]:.3f} | {med[1]:.3f} | {med[2]:.0f} | {med[3]:.0f} | "
              f"{ratio:.2f} |")


if __name__ == "__main__":
    main()
