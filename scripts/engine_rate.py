"""In-process tok/s of the whole engine (its loop thread, scheduler, sampler, detokenizer) for
N concurrent requests, of the checkout on PYTHONPATH: what HTTP serving is measured against.

    PYTHONPATH=CHECKOUT python scripts/engine_rate.py MODEL [--clients 1 8] [--max-tokens 128]
                                [--device cuda] [--temperature T [--top-p P] [--top-k K]] [--rounds R]

Loads MODEL with every pair cached (on the CPU: the C kernels on, 2 threads) into an `Engine`,
then for each client count submits that many `ignore_eos` requests at once (distinct prompts)
and prints the median over R rounds (3) of completion tokens per second from submission to the
last Finished (TTFT included); greedy unless --temperature (then seeded draws). Unlike
scripts/decode_rate.py (the runner alone), the loop's Python per step and per request is in it.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import threading
import time

import torch

from services.bench.quant_bench import load_runner
from services.engine.core import Engine
from services.engine.requests import Delta, EngineRequest, Finished, GenerateParams
from services.engine.sampling import SamplingConfig


def rate(engine: Engine, clients: int, max_tokens: int, tag: str,
         sampling: SamplingConfig) -> float:
    done = threading.Semaphore(0)
    tokens = [0]

    def sink(event: object) -> None:  # the engine's loop thread
        if isinstance(event, Delta):
            tokens[0] += len(event.token_ids)
        elif isinstance(event, Finished):
            done.release()

    started = time.perf_counter()
    for i in range(clients):
        engine.submit(EngineRequest(f"{tag}-{i}", GenerateParams(
                                        max_tokens=max_tokens, ignore_eos=True,
                                        sampling=dataclasses.replace(sampling, seed=i)),
                                    prompt=f"Request {i} of {tag}: tell me about the sea."),
                      sink)
    for _ in range(clients):
        done.acquire()
    return tokens[0] / (time.perf_counter() - started)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    runner = load_runner(a.model, "auto", device=a.device,  # every pair cached
                         cpu_kernels="on" if a.device == "cpu" else "auto")
    engine = Engine(runner, max_running=max(16, *a.clients))
    engine.start()
    try:
        sampling = SamplingConfig(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k)
        rate(engine, 2, 8, "warm-up", sampling)
        for n in a.clients:
            rates = [rate(engine, n, a.max_tokens, f"c{n}-r{r}", sampling) for r in range(a.rounds)]
            print(f"{n} requests: {statistics.median(rates):.0f} tok/s", flush=True)
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
