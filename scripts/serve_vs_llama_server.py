"""Strata's HTTP serving against llama.cpp's llama-server on the same weights, interleaved.

    python scripts/serve_vs_llama_server.py --model CKPT_DIR --gguf SAME_WEIGHTS.gguf \
        --llama-cpp /path/to/llama.cpp [--clients 1 8] [--rounds 2] [--max-tokens 128]
    python scripts/serve_vs_llama_server.py --model CKPT_DIR --device cuda   # no llama-server

Both servers run at once (idle while the other is measured), each round measures every client
count against Strata, then llama-server, then the in-process engine (`strata bench engine`, the
same threads and device as Strata's engine), so drift in the host's memory bandwidth hits all
three alike. Without --gguf and --llama-cpp only Strata and its in-process engine are measured
(on a GPU machine, where no CUDA build of llama.cpp is at hand).
Each client streams `/v1/completions` requests one after another: temperature 0, `ignore_eos`,
`max_tokens` tokens. Per client count: aggregate tok/s (every completion token over the wall
time of the level), per-stream decode tok/s (tokens after the first over the time from first to
last token), TTFT p50 and p90. One JSON object on stdout; progress on stderr.

The client is the benches' own (services/bench/client.py, a connection per request) and counts
tokens from each server's final usage, not from SSE events: Strata sends several tokens in one
event when they are produced together.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from services.bench.client import Gateway, Outcome  # noqa: E402
from services.bench.stats import percentile  # noqa: E402

PROMPT = "The expert cache keeps the pairs that routing uses on the device, and"


def log(line: str) -> None:
    print(f"[serve-bench {time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def stream_once(server: Gateway, max_tokens: int) -> Outcome:
    outcome = await server.complete(PROMPT, max_tokens, ignore_eos=True)
    if not outcome.ok or not outcome.completion_tokens:
        raise RuntimeError(f"{server.base_url}: {outcome.status} {outcome.error_code}: "
                           f"{outcome.error_message or 'a stream without usage'}")
    return outcome


async def level(base: str, clients: int, requests_per_client: int,
                max_tokens: int) -> dict[str, Any]:
    # A connection per request: llama-server closes a stream's connection after it.
    async with Gateway(base, timeout_s=900, keep_alive=False) as server:
        await stream_once(server, 8)  # warm: first-call paths

        async def client() -> list[Outcome]:
            return [await stream_once(server, max_tokens) for _ in range(requests_per_client)]

        t0 = time.perf_counter()
        runs = [r for rs in await asyncio.gather(*(client() for _ in range(clients))) for r in rs]
        wall = time.perf_counter() - t0
    return {"clients": clients, "requests": len(runs),
            "aggregate_tok_s": sum(r.completion_tokens for r in runs) / wall,
            "stream_decode_tok_s": statistics.median(r.client_decode_tok_s for r in runs
                                                     if r.client_decode_tok_s),
            "ttft_p50_ms": statistics.median(r.ttft_s for r in runs) * 1e3,
            "ttft_p90_ms": percentile([r.ttft_s for r in runs], 90) * 1e3}


async def wait_ready(url: str, proc: subprocess.Popen, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {proc.returncode} before it was ready")
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"{what} not ready at {url} after {timeout_s:.0f} s")


def in_process(model: Path, threads: int, device: str, batch: int, max_tokens: int) -> float:
    """`strata bench engine` decode tok/s (aggregate over the batch) with `threads` threads."""
    cmd = [sys.executable, "-m", "services.cli", "bench", "engine", "--model", str(model),
           "--batch", str(batch), "--gen-tokens", str(max_tokens), "--repeat", "1",
           "--threads", str(threads), "--device", device, "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return float(json.loads(done.stdout)["decode_tok_s"])


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("aggregate_tok_s", "stream_decode_tok_s", "ttft_p50_ms", "ttft_p90_ms")
    return {k: statistics.median(r[k] for r in rows) for k in keys}


async def main_async(a: argparse.Namespace) -> dict[str, Any]:
    server = None
    if a.llama_cpp:
        server = shutil.which("llama-server", path=f"{a.llama_cpp}/build/bin:{a.llama_cpp}/bin")
        if server is None:
            raise SystemExit(f"no llama-server under {a.llama_cpp}; build it with "
                             "scripts/build_llama_cpp.sh")
    logs = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    sp, lp = free_port(), free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "STRATA_DEVICE": a.device}
    if a.engine_threads:
        env["STRATA_ENGINE_THREADS"] = str(a.engine_threads)
    up_cmd = [sys.executable, "-m", "services.cli", "up", "--model", str(a.model), "--port",
              str(sp), "--engine-port", str(free_port()), "--cachemgr-port", str(free_port()),
              "--metrics-port", str(free_port()), "--gateway-metrics-port", str(free_port()),
              "--engine-metrics-port", str(free_port()), "--log-dir", str(logs), "--quiet",
              *a.up_arg]
    ls_cmd = [server, "-m", str(a.gguf), "-t", str(a.llama_threads), "-np", str(max(a.clients)),
              "-c", str(a.llama_context), "--port", str(lp), "--host", "127.0.0.1",
              # only /v1/completions is measured; llama-server's jinja cannot parse the demo
              # template's tool-call block, and refuses to start on it
              "--no-jinja", "--chat-template", "chatml"]
    log(f"strata up -> :{sp}" + (f", llama-server -> :{lp}" if server else "") + f"; logs in {logs}")
    with open(logs / "up.out", "w") as up_out, open(logs / "llama-server.out", "w") as ls_out:
        procs = [subprocess.Popen(up_cmd, stdout=up_out, stderr=subprocess.STDOUT, env=env)]
        if server:
            procs.append(subprocess.Popen(ls_cmd, stdout=ls_out, stderr=subprocess.STDOUT))
        try:
            await wait_ready(f"http://127.0.0.1:{sp}/readyz", procs[0], "strata up")
            targets = {"strata": f"http://127.0.0.1:{sp}"}
            if server:
                await wait_ready(f"http://127.0.0.1:{lp}/health", procs[1], "llama-server")
                targets["llama_server"] = f"http://127.0.0.1:{lp}"
            rows: dict[str, dict[int, list]] = {name: {c: [] for c in a.clients}
                                                for name in (*targets, "in_process")}
            for r in range(a.rounds):
                for c in a.clients:
                    for name, base in targets.items():
                        row = await level(base, c, a.requests_per_client,
                                          a.max_tokens)
                        rows[name][c].append(row)
                        log(f"round {r + 1}/{a.rounds}, {c} client(s), {name}: "
                            f"{row['aggregate_tok_s']:.1f} tok/s aggregate, "
                            f"{row['stream_decode_tok_s']:.1f} per stream, TTFT p50 "
                            f"{row['ttft_p50_ms']:.0f} ms, p90 {row['ttft_p90_ms']:.0f} ms")
                if a.engine_threads:
                    tok_s = await asyncio.to_thread(in_process, a.model, a.engine_threads,
                                                    a.device, 1, a.max_tokens)
                    rows["in_process"][1].append({"stream_decode_tok_s": tok_s})
                    log(f"round {r + 1}/{a.rounds}, in-process engine, batch 1, "
                        f"{a.engine_threads} threads: {tok_s:.1f} tok/s")
        finally:
            for proc in procs:
                proc.send_signal(2)  # SIGINT: strata up drains and stops its children
            for proc in procs:
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    out: dict[str, Any] = {"command": " ".join(sys.argv), "max_tokens": a.max_tokens,
                           "llama_server": " ".join(ls_cmd) if server else None, "levels": {}}
    for c in a.clients:
        s = summarize(rows["strata"][c])
        out["levels"][c] = {"strata": s, "rounds": {k: rows[k][c] for k in targets}}
        if server:
            l_ = summarize(rows["llama_server"][c])
            out["levels"][c] |= {"llama_server": l_,
                                 "ratio_aggregate": s["aggregate_tok_s"] / l_["aggregate_tok_s"]}
    if rows["in_process"][1]:
        tok_s = statistics.median(r["stream_decode_tok_s"] for r in rows["in_process"][1])
        out["in_process_decode_tok_s"] = tok_s
        if 1 in out["levels"]:
            out["http_over_in_process"] = out["levels"][1]["strata"]["stream_decode_tok_s"] / tok_s
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="Strata checkpoint directory")
    p.add_argument("--gguf", type=Path, help="the same weights as a GGUF file")
    p.add_argument("--llama-cpp", type=Path, help="a llama.cpp build directory")
    p.add_argument("--device", default="auto", help="STRATA_DEVICE for strata up and the "
                   "in-process engine's --device (auto, cpu, cuda)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--llama-threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--llama-context", type=int, default=8192,
                   help="llama-server's -c (shared by its -np slots)")
    p.add_argument("--engine-threads", type=int, default=None, help="STRATA_ENGINE_THREADS "
                   "for strata up (default: its own rule), and the in-process comparison's "
                   "threads (skipped without it)")
    p.add_argument("--up-arg", action="append", default=[], help="extra `strata up` argument")
    a = p.parse_args()
    if (a.gguf is None) != (a.llama_cpp is None):
        p.error("--gguf and --llama-cpp go together (or neither, to measure Strata alone)")
    if a.device == "auto":  # as the engine resolves it
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    print(json.dumps(asyncio.run(main_async(a)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
