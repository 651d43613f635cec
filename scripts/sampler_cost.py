"""What picking one token costs, per request and step: `Sampler.sample` on one row of logits,
for the sampling settings clients send, at a few vocabulary sizes.

    PYTHONPATH=CHECKOUT python scripts/sampler_cost.py [--vocab 32000 151936] [--rounds 30]

Two shapes of logits: `flat` (random N(0, 3^2), a random-weight model's: top-p keeps most of
the vocabulary) and `peaked` (N(0, 1.5^2) with 50 tokens 12 higher, a trained model's: a
few dozen likely tokens). Prints the median microseconds a call per setting; run it with two
checkouts on PYTHONPATH, alternating, to compare them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from services.engine.sampling import Sampler, SamplingConfig

SETTINGS = {  # what the OpenAI API defaults to, and what model cards recommend
    "greedy": dict(temperature=0.0),
    "temperature 1 (OpenAI's default)": dict(temperature=1.0),
    "temperature 0.7, top-p 0.9": dict(temperature=0.7, top_p=0.9),
    "temperature 0.7, top-k 20, top-p 0.8": dict(temperature=0.7, top_k=20, top_p=0.8),
    "temperature 0.6, top-p 0.95": dict(temperature=0.6, top_p=0.95),
    "temperature 0.7, min-p 0.05": dict(temperature=0.7, min_p=0.05),
}


def logits(vocab: int, shape: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(vocab)
    if shape == "flat":
        return torch.randn(vocab, generator=g) * 3
    x = torch.randn(vocab, generator=g) * 1.5
    x[torch.randperm(vocab, generator=g)[:50]] += 12
    return x


def cost_us(sampler: Sampler, x: torch.Tensor, rounds: int) -> float:
    sampler.sample(x)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        sampler.sample(x)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print("| setting | " + " | ".join(f"{v} {s}" for v in a.vocab for s in ("flat", "peaked"))
          + " |")
    print("|---|" + "---|" * (2 * len(a.vocab)))
    for name, kwargs in SETTINGS.items():
        cells = []
        for vocab in a.vocab:
            for shape in ("flat", "peaked"):
                sampler = Sampler(SamplingConfig(seed=0, **kwargs))
                cells.append(f"{cost_us(sampler, logits(vocab, shape), a.rounds):.0f}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
