"""What a new prompt costs the streams already decoding: the engine step that reads it against
the steps that only decode.

    python scripts/prompt_step.py [MODEL] [--running 0 7] [--threads 2]

Loads MODEL (default: the shipped model) with every pair cached into an `Engine`. For each
count N in --running: N chat requests decode (`ignore_eos`), and three more arrive one after
another while they do; prints each newcomer's prompt length and `prefill_ms` (admission to its
first token), the wall time of the steps that took a prompt, and the median of the steps that
only decoded.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from services.bench.quant_bench import load_runner
from services.engine.core import Engine
from services.engine.requests import EngineRequest, Finished, GenerateParams
from services.models import default_model_dir


def measure(engine: Engine, running: int, steps: list[tuple[bool, float]]) -> str:
    done = threading.Semaphore(0)
    stats = {}

    def sink(tag: str):
        def on_event(event: object) -> None:
            if isinstance(event, Finished):
                stats[tag] = event.stats
                done.release()
        return on_event

    def submit(tag: str, max_tokens: int, text: str) -> None:
        engine.submit(EngineRequest(f"{tag}-{time.monotonic_ns()}", GenerateParams(
            max_tokens=max_tokens, ignore_eos=True), messages=(("user", text),)), sink(tag))

    for i in range(running):
        submit(f"bg{i}", 240, f"Request {i}: tell me about the sea and the expert cache.")
    time.sleep(0.1)
    steps.clear()
    for j in range(3):
        submit(f"new{j}", 4, f"Newcomer {j} at {time.time()}: what is in the cache now?")
        done.acquire()
        time.sleep(0.05)
    for _ in range(running):
        done.acquire()
    prompts = [stats[f"new{j}"] for j in range(3)]
    with_prompt = [f"{t * 1e3:.1f}" for took, t in steps if took]
    decode_only = [t for took, t in steps if not took]
    return (f"{running} decoding: newcomers' prompts "
            f"{', '.join(f'{s.prompt_tokens} tokens in {s.prefill_ms:.1f} ms' for s in prompts)}"
            f"; steps taking a prompt {' / '.join(with_prompt)} ms; decode-only steps "
            f"{statistics.median(decode_only) * 1e3 if decode_only else 0:.2f} ms (median)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=str(default_model_dir()))
    p.add_argument("--running", type=int, nargs="+", default=[0, 7])
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    runner = load_runner(a.model, "auto", device="cpu", cpu_kernels="on")
    engine = Engine(runner, max_running=16)
    steps: list[tuple[bool, float]] = []
    step = engine._step

    def timed() -> None:  # the loop thread: is a prompt read in this step?
        sched = engine.scheduler
        takes = bool(sched.waiting) or any(s.num_pending > 1 for s in sched.running)
        t0 = time.perf_counter()
        step()
        steps.append((takes, time.perf_counter() - t0))

    engine._step = timed
    engine.start()
    try:
        measure(engine, 2, steps)  # warm-up
        for n in a.running:
            print(measure(engine, n, steps), flush=True)
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
