"""CPU time per streamed token of each Strata process and thread, while clients stream.

    python scripts/token_cpu.py --url http://127.0.0.1:8000 --engine PID --gateway PID \
        [--cachemgr PID] [--redis PID] [--clients 1] [--requests 4] [--max-tokens 128]

Against a running `strata up`: each client streams `--requests` completions one after another
(temperature 0, `ignore_eos`); the CPU time of every thread of the given processes
(/proc/PID/task/*/stat, user + system) and of this client is read before and after, and
printed per completion token. Where a token's microseconds go (docs/benchmarks.md, "The
serving path"). Linux only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.bench.client import Gateway  # noqa: E402

PROMPT = "The expert cache keeps the pairs that routing uses on the device, and"
TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of pid, keyed 'name:tid'."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except FileNotFoundError:  # the thread ended
            continue
        name = stat.split("(", 1)[1].rsplit(")", 1)[0]
        fields = stat.rsplit(")", 1)[1].split()
        out[f"{name}:{tid}"] = (int(fields[11]) + int(fields[12])) * TICK_S
    return out


async def stream(url: str, clients: int, requests: int, max_tokens: int) -> tuple[int, float]:
    """(completion tokens, wall seconds) of `clients` clients streaming one after another."""
    async with Gateway(url) as gateway:
        await gateway.complete(PROMPT, 8, ignore_eos=True)  # warm

        async def client() -> int:
            tokens = 0
            for _ in range(requests):
                outcome = await gateway.complete(PROMPT, max_tokens, ignore_eos=True)
                if not outcome.ok:
                    raise RuntimeError(f"{outcome.status} {outcome.error_code}: "
                                       f"{outcome.error_message}")
                tokens += outcome.completion_tokens or 0
            return tokens

        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(client() for _ in range(clients))))
        return tokens, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    for name in ("engine", "gateway", "cachemgr", "redis"):
        p.add_argument(f"--{name}", type=int, help=f"pid of the {name}")
    p.add_argument("--clients", type=int, default=1)
    p.add_argument("--requests", type=int, default=4, help="per client")
    p.add_argument("--max-tokens", type=int, default=128)
    a = p.parse_args()
    pids = {n: getattr(a, n) for n in ("engine", "gateway", "cachemgr", "redis")
            if getattr(a, n)}
    before = {n: thread_cpu_s(pid) for n, pid in pids.items()}
    client_before = time.process_time()
    tokens, wall_s = asyncio.run(stream(a.url, a.clients, a.requests, a.max_tokens))
    client_s = time.process_time() - client_before
    after = {n: thread_cpu_s(pid) for n, pid in pids.items()}
    print(f"{tokens} tokens in {wall_s:.2f} s = {tokens / wall_s:.1f} tok/s, {a.clients} "
          "client(s); CPU per token:")
    for name in pids:
        spent = {t: s - before[name].get(t, 0.0) for t, s in after[name].items()}
        print(f"  {name}: {sum(spent.values()) / tokens * 1e6:.0f} us "
              f"({sum(spent.values()) / wall_s * 100:.0f}% of a core)")
        for thread, s in sorted(spent.items()):
            if s > 0:
                print(f"    thread {thread}: {s / tokens * 1e6:.0f} us")
    print(f"  this client: {client_s / tokens * 1e6:.0f} us")


if __name__ == "__main__":
    main()
