"""Two builds of the CPU kernels on the routed-expert kernel, interleaved in one process.

    python scripts/kernel_ab.py OLD.c NEW.c [D F] [--types Q8_0,Q4_K,F32] [--experts 32]
                                [--routed 8] [--rows 1 4] [--layers 1] [--linear N]
                                [--attention HEAD_DIM [--heads H G] [--positions N]]
                                [--inputs-major new|old,new]
    git show HEAD:services/engine/kernels/cpu_kernels.c > /tmp/old.c   # e.g. HEAD vs the tree
    python scripts/kernel_ab.py /tmp/old.c services/engine/kernels/cpu_kernels.c
    python scripts/kernel_ab.py /tmp/old.c services/engine/kernels/cpu_kernels.c 512 256 \
        --types F32 --experts 64 --rows 1 8 --layers 8 --linear 32000   # the bench preset

Compiles each source with the engine's flags (both must have this checkout's ABI_VERSION),
loads both libraries, and times `strata_moe` on random experts of each type (GGUF block types,
or F32 / BF16 dense blobs; Qwen3-30B-A3B's expert shape by default) for each row count, the two
builds alternating within every round so that drift in the host's memory bandwidth hits both
alike. `--layers L` cycles the calls over L layers' experts (L x E blobs: more than the caches
hold, as in a decode step); `--linear N` also times `strata_linear` of D inputs to N fp32
outputs (an lm_head); `--attention HEAD_DIM` also times `strata_decode_attention` (`--heads H
G` query and KV heads, 4 and 2 by default; each row a third of `--positions` to all of it deep).
`--inputs-major new` gives the new build the dense experts transposed (cache/layout.py's
[in, out] layout, as small experts are kept on the CPU): the same weights, the outputs equal
to rounding; `--inputs-major old,new` gives it both. Prints the best round's GB/s of each and
whether their outputs are bit-identical (else their largest difference). Threads: torch's
(OMP_NUM_THREADS).
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
from services.engine.cache.layout import ExpertLayout, num_splits  # noqa: E402

DENSE = {"F32": "fp32", "BF16": "bf16"}  # dense blob types: strata_moe's `weights`


def experts(t: str, E: int, D: int, F: int, rng: np.random.Generator) -> torch.Tensor:
    """[E, blob]: E random expert blobs of type t (a GGUF block type, F32 or BF16)."""
    if t not in DENSE:
        return block_experts(t, E, D, F, rng)
    dtype = torch.float32 if t == "F32" else torch.bfloat16
    return (torch.randn(E, ExpertLayout(D, F).numel) * 0.05).to(dtype)


def inputs_major(blobs: torch.Tensor, D: int, F: int) -> torch.Tensor:
    """[E, blob] dense blobs in cache/layout.py's [out, in] layout, repacked [in, out]."""
    rows, cols = ExpertLayout(D, F), ExpertLayout(D, F, inputs_major=True)
    out = torch.empty_like(blobs)
    for blob, dst in zip(blobs, out, strict=True):
        gate_up, down = rows.parts(blob)
        cols.pack(gate_up[0], gate_up[1], down, dst)
    return out


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
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4], help="tokens per call")
    p.add_argument("--layers", type=int, default=1, help="sets of experts the calls cycle over")
    p.add_argument("--linear", type=int, default=0, help="also time a D x N fp32 linear")
    p.add_argument("--attention", type=int, default=0, help="also time decode attention at "
                   "this head dim")
    p.add_argument("--heads", type=int, nargs=2, default=[4, 2], metavar=("H", "G"),
                   help="decode attention's query and KV heads")
    p.add_argument("--positions", type=int, default=300, help="decode attention's deepest row "
                   "(each row a third of it to all of it)")
    p.add_argument("--inputs-major", default="", help="the builds (new, or old,new) that read "
                   "the dense experts in the [in, out] layout (the same weights, transposed)")
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
    blobs = {t: [experts(t, E, D, F, rng) for _ in range(a.layers)] for t in types}
    # what each build reads: with --inputs-major, the dense blobs transposed
    side = {(t, name): (layers, DENSE.get(t, "blocks")) for t, layers in blobs.items()
            for name in ("old", "new")}
    for name in filter(None, a.inputs_major.split(",")):
        for t in set(types) & set(DENSE):
            side[t, name] = ([inputs_major(b, D, F) for b in blobs[t]], DENSE[t] + "_io")
    lm_head = torch.randn(a.linear, D) * 0.05 if a.linear else None  # [N, D]
    for T in a.rows:
        x = torch.randn(T, D)
        top_idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
        top_w = torch.rand(T, K)
        routed = len(set(top_idx.flatten().tolist()))
        times: dict[tuple[str, str], list[float]] = {}
        outputs: dict[tuple[str, str], torch.Tensor] = {}
        gbs: dict[str, float] = {}
        for _ in range(a.rounds):
            for t, layers in blobs.items():
                kind = {} if t in DENSE else {"block_types": (t,) * 3}
                gbs[t] = routed * layers[0][0].numel() * layers[0].element_size() / 1e9
                for name, cpu in libs.items():
                    read, weights = side[t, name]
                    addrs = [np.array([blob.data_ptr() for blob in b], dtype=np.int64)
                             for b in read]
                    outputs[t, name] = cpu.moe(x, top_idx, top_w, addrs[0], F, num_splits(D),
                                               weights=weights, **kind)
                    t0 = time.perf_counter()
                    for c in range(a.calls):
                        cpu.moe(x, top_idx, top_w, addrs[c % a.layers], F, num_splits(D),
                                weights=weights, **kind)
                    times.setdefault((t, name), []).append((time.perf_counter() - t0) / a.calls)
            if lm_head is not None:
                gbs["linear"] = lm_head.numel() * 4 / 1e9
                for name, cpu in libs.items():
                    outputs["linear", name] = cpu.linear(x, lm_head)
                    t0 = time.perf_counter()
                    for _ in range(a.calls):
                        cpu.linear(x, lm_head)
                    times.setdefault(("linear", name), []).append(
                        (time.perf_counter() - t0) / a.calls)
            if a.attention:
                (H, G), Hd, P, n = a.heads, a.attention, 16, a.positions
                per_row = -(-n // P)
                blocks = max(64, T * per_row)
                q = torch.randn(T, H, Hd)
                k_pool, v_pool = torch.randn(2, blocks, P, G, Hd)
                tables = torch.stack([torch.randperm(blocks)[:per_row] for _ in range(T)])
                lengths = torch.randint(n // 3, n, (T,), generator=torch.Generator().manual_seed(T))
                gbs["attention"] = int(lengths.sum()) * G * 2 * Hd * 4 / 1e9  # K and V read
                for name, cpu in libs.items():
                    args = (q, k_pool, v_pool, tables, lengths, per_row * P)
                    outputs["attention", name] = cpu.decode_attention(*args)
                    t0 = time.perf_counter()
                    for _ in range(a.calls):
                        cpu.decode_attention(*args)
                    times.setdefault(("attention", name), []).append(
                        (time.perf_counter() - t0) / a.calls)
        for t, gb in gbs.items():
            old, new = min(times[t, "old"]), min(times[t, "new"])
            o, n = outputs[t, "old"], outputs[t, "new"]
            same = "identical" if torch.equal(o, n) else (
                f"DIFFER (max {float((o - n).abs().max() / o.abs().max()):.1e} of the largest)")
            what = {"linear": f"linear {D} x {a.linear}",
                    "attention": f"decode attention, head dim {a.attention}"}.get(
                        t, f"{t} ({routed} experts)")
            print(f"T={T} {what}: old {gb / old:.1f} GB/s ({old * 1e3:.2f} ms), new "
                  f"{gb / new:.1f} GB/s ({new * 1e3:.2f} ms), new/old {old / new:.2f}x, "
                  f"outputs {same}")


if __name__ == "__main__":
    main()
