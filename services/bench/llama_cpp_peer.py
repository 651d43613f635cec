"""llama.cpp on the same GGUF file, for `strata bench engine --peer-llama-cpp DIR`.

One `run()` per Strata round, so the two engines' rounds interleave on a host whose bandwidth
drifts: batch 1 runs `llama-bench` twice (`-p P -n 0`, the prompt's prefill; `-p 0 -n G-1
-d P`, decode after a P-token context, as Strata decodes), batch B runs `llama-batched-bench
-npp P -ntg G -npl B` (B sequences of P prompt tokens, then G decode steps each). Both on
`--threads` threads, one repetition each. A llama.cpp build: scripts/build_llama_cpp.sh.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any


class PeerError(RuntimeError):
    pass


def _tool(build_dir: Path, name: str) -> Path:
    for path in (build_dir / "build" / "bin" / name, build_dir / "bin" / name, build_dir / name):
        if path.is_file():
            return path
    raise PeerError(f"no {name} under {build_dir} (looked in build/bin, bin and the directory "
                    "itself); build llama.cpp with scripts/build_llama_cpp.sh DIR")


class LlamaCppPeer:
    def __init__(self, build_dir: Path, model: Path, batch: int, prompt_tokens: int,
                 gen_tokens: int, threads: int):
        if model.suffix != ".gguf" or not model.is_file():
            raise PeerError(f"--peer-llama-cpp runs llama.cpp on the same file: --model must "
                            f"be a .gguf file, not {model}")
        self.tool = _tool(build_dir, "llama-bench" if batch == 1 else "llama-batched-bench")
        self.model, self.batch, self.threads = model, batch, threads
        self.prompt_tokens, self.gen_tokens = prompt_tokens, gen_tokens

    def describe(self) -> str:
        return f"{self.tool.name} ({self.tool}), {self.threads} threads"

    def _run(self, *args: str) -> str:
        cmd = [str(self.tool), "-m", str(self.model), "-t", str(self.threads), *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise PeerError(f"{' '.join(cmd)} exited {done.returncode}: "
                            f"{done.stderr.strip()[-800:]}")
        return done.stdout

    def run(self) -> dict[str, Any]:
        """One round: {"prefill_tok_s", "decode_tok_s"} (decode: aggregate over the batch)."""
        P, G = self.prompt_tokens, self.gen_tokens
        if self.batch == 1:
            (pp,) = json.loads(self._run("-p", str(P), "-n", "0", "-r", "1", "-o", "json"))
            (tg,) = json.loads(self._run("-p", "0", "-n", str(G - 1), "-d", str(P), "-r", "1",
                                         "-o", "json"))
            return {"prefill_tok_s": float(pp["avg_ts"]), "decode_tok_s": float(tg["avg_ts"])}
        out = self._run("-npp", str(P), "-ntg", str(G), "-npl", str(self.batch),
                        "--output-format", "jsonl")
        rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        if not rows:
            raise PeerError(f"{self.tool.name} printed no result line: {out[-400:]}")
        return {"prefill_tok_s": float(rows[-1]["speed_pp"]),
                "decode_tok_s": float(rows[-1]["speed_tg"])}
