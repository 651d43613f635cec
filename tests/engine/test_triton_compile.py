"""The Triton kernels compile for a CUDA target (scripts/triton_compile.py: Triton's own
pipeline down to a cubin, with the ptxas its wheel carries; no device needed). Run in a child
process: the other Triton tests interpret the kernels (TRITON_INTERPRET), which this must not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not (Path(triton.__file__).parent / "backends/nvidia/bin/ptxas").exists(),
                    reason="this Triton has no CUDA backend")
def test_expert_and_block_matrix_kernels_compile_for_sm_86(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled here, not taken from a cache
    kinds = ["dense", "q4_k+q6_k", "q8_0", "mxfp4", "iq4_xs", "fp8", "gpt_oss"]
    done = subprocess.run([sys.executable, str(ROOT / "scripts/triton_compile.py"), "--arch",
                           "86", "--kinds", *kinds], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "all compiled"
    compiled = [line for line in lines if line.startswith("sm_86 bf16 ")]
    # gate_up and down for each kind, the block-matrix product for each block type listed and
    # the FP8 matrix product
    assert len(compiled) == 2 * len(kinds) + 4, lines
    assert all("registers" in line for line in compiled)
