"""In-process decode tok/s of the checkout on PYTHONPATH: one number, for comparing checkouts.

    PYTHONPATH=CHECKOUT python scripts/decode_rate.py MODEL [--batch B] [--gen-tokens G]
                                                      [--prompt-tokens P]

Loads MODEL with every pair cached (the C kernels on, 2 threads), warms up, then
prints the median decode tok/s of three runs of B sequences (P-token prompts, 32 by default;
G - 1 decode steps: with a long P, decode at that depth of context). Run it alternately on two
checkouts, several times, so that the host's drift hits both:

    for r in 1 2 3; do for c in /tmp/old /work/main; do
        PYTHONPATH=$c python scripts/decode_rate.py /tmp/bench-bf16.gguf; done; done
"""

from __future__ import annotations

import argparse
import statistics

import torch

from services.bench.engine_bench import prompts, run_strata
from services.bench.quant_bench import load_runner


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--gen-tokens", type=int, default=65)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=32)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    runner = load_runner(a.model, "auto", cpu_kernels="on")  # every pair cached
    batch_prompts = prompts(a.batch, a.prompt_tokens)
    run_strata(runner, batch_prompts, 8)  # warm-up
    rates = []
    for _ in range(3):
        _, decode_s, _, _ = run_strata(runner, batch_prompts, a.gen_tokens)
        rates.append(a.batch * (a.gen_tokens - 1) / decode_s)
    print(f"{statistics.median(rates):.1f}")


if __name__ == "__main__":
    main()
