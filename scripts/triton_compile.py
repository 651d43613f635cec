"""Compile the Triton expert and block-matrix kernels for CUDA targets, with no device needed.

    python scripts/triton_compile.py [--arch 86 90] [--dtype bf16 fp32] [--kinds q4_k fp8 ...]

Triton's wheel carries ptxas, so its whole pipeline (Python AST -> TTIR -> PTX -> cubin) runs
on a machine without a GPU: every weight kind the kernels take (dense, each GGUF block type,
FP8, gpt-oss's MXFP4 experts with biases) is compiled for each architecture and activation dtype at a real model's shape, and the
cubin's registers and stack (spilled bytes) are printed. Exit status 1 if any fails to compile.
The interpreter tests (tests/engine/test_gpu_moe.py) check what the kernels compute; this
checks that the compiler takes them. sm_86 is the oldest target that matters here (RTX 3090,
A6000, A10: 24-48 GB cards); sm_89 and sm_90 the rest.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if os.environ.get("TRITON_INTERPRET"):
    sys.exit("TRITON_INTERPRET is set: the kernels would be interpreted, not compiled")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from services.engine.cache.formats import BlockFormat  # noqa: E402
from services.engine.kernels import gpu_blocks, gpu_moe  # noqa: E402
from services.engine.model.blocks import BLOCK_TYPES, block_type  # noqa: E402
from services.engine.model.layers.mlp import ExpertMlp  # noqa: E402

D, F, N = 2048, 768, 5120  # Qwen3-30B-A3B's hidden size, expert FFN, q | k | v rows


def expert_weights() -> dict[str, gpu_moe.Weights]:
    kinds = {"dense": gpu_moe.Weights(), "fp8": gpu_moe.Weights.fp8((128, 128))}
    for name in BLOCK_TYPES:  # each type in every role; Q4_K_M's mix too
        kinds[name.lower()] = gpu_moe.Weights.blocks((name,) * 3, D, F)
    kinds["q4_k+q6_k"] = gpu_moe.Weights.blocks(("Q4_K", "Q4_K", "Q6_K"), D, F)
    # gpt-oss's experts: MXFP4, the clamped SwiGLU, biases after the weights
    kinds["gpt_oss"] = gpu_moe.Weights.of(BlockFormat(D, F, {0: ("MXFP4",) * 3},
                                                      mlp=ExpertMlp("clamped", bias=True)))
    return kinds


def kernels(dtype: str):
    """(name, jit function, signature, constexprs) of every kernel variant."""
    tile = dict(BLOCK_M=gpu_moe.BLOCK_M, BLOCK_F=gpu_moe.BLOCK_F, BLOCK_D=gpu_moe.BLOCK_D)
    ieee = dtype == "fp32"
    for name, w in expert_weights().items():
        consts = dict(D=D, F=F, IEEE=ieee, **w.constants(), **tile)
        sig = {"x_ptr": f"*{dtype}", "tok_ptr": "*i64", "g_addr_ptr": "*i64",
               "g_start_ptr": "*i64", "g_len_ptr": "*i64", "act_ptr": f"*{dtype}",
               "lut": "*fp32"}
        yield f"gate_up {name}", gpu_moe._gate_up_kernel, sig, consts
        sig = {"act_ptr": f"*{dtype}", "dst_ptr": "*i64", "w_ptr": f"*{dtype}",
               "g_addr_ptr": "*i64", "g_start_ptr": "*i64", "g_len_ptr": "*i64",
               "y_ptr": "*fp32", "lut": "*fp32"}
        yield f"down {name}", gpu_moe._down_kernel, sig, consts
    linear = dict(N=N, K=D, FP8=False, ROW_BYTES=0, TYPE=0, BO=1, BI=1, IEEE=ieee,
                  BLOCK_T=gpu_blocks.BLOCK_T, BLOCK_N=gpu_blocks.BLOCK_N,
                  BLOCK_K=gpu_blocks.BLOCK_K)
    sig = {"x_ptr": f"*{dtype}", "w_ptr": "*u8", "s_ptr": "*fp32", "y_ptr": f"*{dtype}",
           "lut": "*fp32", "T": "i32", "x_stride": "i32", "y_stride": "i32"}
    for name in BLOCK_TYPES:
        t = block_type(name)
        consts = {**linear, "ROW_BYTES": t.row_bytes(D), "TYPE": t.kernel}
        yield f"linear {name.lower()}", gpu_blocks._linear_kernel, sig, consts
    yield ("linear fp8", gpu_blocks._linear_kernel, sig,
           {**linear, "FP8": True, "BO": 128, "BI": 128})


def resources(cubin: bytes) -> str:
    """REG and STACK of a cubin, by the cuobjdump next to Triton's ptxas."""
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name],
                             capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return f"{found[1]} registers, {found[2]} B stack" if found else "resources unknown"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, nargs="+", default=[86, 90])
    p.add_argument("--dtype", nargs="+", default=["bf16"], choices=["bf16", "fp16", "fp32"])
    p.add_argument("--kinds", nargs="+", help="only these weight kinds (dense, fp8, q8_0, "
                   "q4_k+q6_k, ...; default all)")
    a = p.parse_args()
    failed = 0
    for arch in a.arch:
        target = GPUTarget("cuda", arch, 32)
        for dtype in a.dtype:
            for name, fn, sig, consts in kernels(dtype):
                if a.kinds and name.split()[1] not in a.kinds:
                    continue
                sig = {**sig, **{k: "constexpr" for k in consts}}
                try:
                    k = triton.compile(ASTSource(fn, sig, consts), target=target)
                except Exception as e:  # noqa: BLE001 - reported, then the exit status
                    failed += 1
                    print(f"sm_{arch} {dtype} {name}: FAILED {type(e).__name__}: {e}")
                    continue
                print(f"sm_{arch} {dtype} {name}: {resources(k.asm['cubin'])}", flush=True)
    print(f"{failed} failed" if failed else "all compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
