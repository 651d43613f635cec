"""One MoE layer's routed experts through the C kernel: bf16 blobs against GGUF block types.

    python scripts/moe_micro.py [D F] [--experts 16] [--routed 8] [--calls 50]
                                [--types Q8_0,Q4_K,Q6_K]

Prints ms per call (the best of three interleaved rounds of `--calls` calls) and the weight
bytes read per second, at 1 and 4 token rows. Threads: torch's (OMP_NUM_THREADS).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from services.engine import kernels  # noqa: E402
from services.engine.cache.layout import ExpertLayout, num_splits  # noqa: E402
from tests.engine.test_block_kernels import random_rows  # noqa: E402  (random valid blocks)


def random_blocks(name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random rows of blocks of a type, flat (tests/engine/test_block_kernels.py's)."""
    return random_rows(name, rows, cols, rng).reshape(-1)


def block_experts(name: str, E: int, D: int, F: int, rng: np.random.Generator) -> torch.Tensor:
    """uint8 [E, blob bytes]: E random expert blobs of one block type (gate, up, down rows)."""
    return torch.from_numpy(np.stack([np.concatenate(
        [random_blocks(name, F, D, rng), random_blocks(name, F, D, rng),
         random_blocks(name, D, F, rng)]) for _ in range(E)]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("D", type=int, nargs="?", default=2048)
    p.add_argument("F", type=int, nargs="?", default=768)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--routed", type=int, default=8)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--types", default="Q8_0,Q4_K,Q6_K", help="GGUF block types to time")
    a = p.parse_args()
    D, F, E, K = a.D, a.F, a.experts, a.routed
    cpu = kernels.CpuKernels(kernels.build())
    rng = np.random.default_rng(0)

    blobs = {"bf16": (torch.randn(E, ExpertLayout(D, F).numel) * 0.1).bfloat16()}
    for name in a.types.split(","):
        blobs[name] = block_experts(name, E, D, F, rng)
    for T in (1, 4):
        x = torch.randn(T, D)
        top_idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
        top_w = torch.rand(T, K)
        routed = len(set(top_idx.flatten().tolist()))
        best: dict[str, float] = {}
        for _ in range(3):
            for name, b in blobs.items():
                addr = np.array([blob.data_ptr() for blob in b], dtype=np.int64)

                args = (x, top_idx, top_w, addr, F, num_splits(D))
                kw = (dict(weights="bf16") if name == "bf16"
                      else dict(weights="blocks", block_types=(name,) * 3))
                for _ in range(3):
                    cpu.moe(*args, **kw)
                t0 = time.perf_counter()
                for _ in range(a.calls):
                    cpu.moe(*args, **kw)
                dt = (time.perf_counter() - t0) / a.calls
                best[name] = min(dt, best.get(name, dt))
        for name, dt in best.items():
            blob_bytes = blobs[name][0].numel() * blobs[name].element_size()
            print(f"T={T} {name}: {dt * 1e3:.3f} ms, {routed * blob_bytes / dt / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
