"""Two builds of the CPU kernels on the routed-expert kernel, interleaved in one process.

    python scripts/kernel_ab.py OLD.c NEW.c [--types Q8_0,Q4_K] [--experts 32] [--routed 8]
    git show HEAD:services/engine/kernels/cpu_kernels.c > /tmp/old.c   # e.g. HEAD vs the tree
    python scripts/kernel_ab.py /tmp/old.c services/engine/kernels/cpu_kernels.c

Compiles each source with the engine's flags (both must have this checkout's ABI_VERSION),
loads both libraries, and times `strata_moe` on random blocks of each GGUF type (Qwen3-30B-A3B's
expert shape by default), the two builds alternating within every round so that drift in the
host's memory bandwidth hits both alike. Prints the best round's GB/s of each and whether their
outputs are bit-identical. Threads: torch's (OMP_NUM_THREADS).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from moe_micro import block_experts  # noqa: E402  (this directory: the same random experts)

from services.engine import kernels  # noqa: E402
from services.engine.cache.layout import num_splits  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old", type=Path)
    p.add_argument("new", type=Path)
    p.add_argument("D", type=int, nargs="?", default=2048)
    p.add_argument("F", type=int, nargs="?", default=768)
    p.add_argument("--types", default="Q8_0,Q4_0,Q4_K,Q6_K")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--routed", type=int, default=8)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    out = Path(tempfile.mkdtemp(prefix="kernel-ab-"))
    libs = {}
    for name, src in (("old", a.old), ("new", a.new)):
        lib = out / f"{name}.so"
        subprocess.run([kernels.find_compiler() or "cc", *kernels.FLAGS, "-o", str(lib),
                        str(src)], check=True)
        libs[name] = kernels.CpuKernels(lib)
    D, F, E, K = a.D, a.F, a.experts, a.routed
    rng = np.random.default_rng(0)
    types = a.types.split(",")
    blobs = {t: block_experts(t, E, D, F, rng) for t in types}
    for T in (1, 4):
        x = torch.randn(T, D)
        top_idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
        top_w = torch.rand(T, K)
        routed = len(set(top_idx.flatten().tolist()))
        times: dict[tuple[str, str], list[float]] = {}
        outputs: dict[tuple[str, str], torch.Tensor] = {}
        for _ in range(a.rounds):
            for t, b in blobs.items():
                addr = np.array([blob.data_ptr() for blob in b], dtype=np.int64)
                args = (x, top_idx, top_w, addr, F, num_splits(D))
                for name, cpu in libs.items():
                    outputs[t, name] = cpu.moe(*args, weights="blocks", block_types=(t,) * 3)
                    t0 = time.perf_counter()
                    for _ in range(a.calls):
                        cpu.moe(*args, weights="blocks", block_types=(t,) * 3)
                    times.setdefault((t, name), []).append((time.perf_counter() - t0) / a.calls)
        for t in types:
            gb = routed * blobs[t][0].numel() / 1e9
            old, new = min(times[t, "old"]), min(times[t, "new"])
            same = torch.equal(outputs[t, "old"], outputs[t, "new"])
            print(f"T={T} {t}: old {gb / old:.1f} GB/s, new {gb / new:.1f} GB/s, new/old "
                  f"{old / new:.2f}x, outputs {'identical' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
