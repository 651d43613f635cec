"""The gateway's CPU per request: a chat completion against the same answer through the
Responses API, stored and not, rounds alternating.

    strata up &
    python scripts/responses_cost.py [--url http://127.0.0.1:8000] [--requests 200]
                                     [--rounds 3] [--max-tokens 8] [--stream]

Each request asks for the same short answer (temperature 0), one after another on one
connection; the gateway's process CPU (utime + stime from /proc) is read around each batch, so
the figure is what the gateway spends on a request beside the engine's work. The gateway's pid
is found with pgrep (`--gateway-pid` to give it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import time

import aiohttp

TEXT = "the system keeps a cache of experts in device memory"


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _gateway_pid() -> int:
    found = subprocess.run(["pgrep", "-f", "services.gateway"], capture_output=True, text=True)
    pids = found.stdout.split()
    if len(pids) != 1:
        raise SystemExit(f"found {len(pids)} gateway processes; give --gateway-pid")
    return int(pids[0])


async def _main(args: argparse.Namespace) -> None:
    pid = args.gateway_pid or _gateway_pid()
    kinds = {
        "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": TEXT}],
                                          "max_tokens": args.max_tokens}),
        "responses, store false": ("/v1/responses", {"input": TEXT, "store": False,
                                                     "max_output_tokens": args.max_tokens}),
        "responses, stored": ("/v1/responses", {"input": TEXT,
                                                "max_output_tokens": args.max_tokens}),
    }
    async with aiohttp.ClientSession() as http:
        models = await (await http.get(args.url + "/v1/models")).json()
        model = models["data"][0]["id"]

        async def one(path: str, body: dict) -> None:
            async with http.post(args.url + path, json={
                    "model": model, "temperature": 0, "stream": args.stream, **body}) as r:
                await r.read()
                if r.status != 200:
                    raise SystemExit(f"{path} answered {r.status}: {await r.text()}")

        cpu: dict[str, list[float]] = {k: [] for k in kinds}
        wall: dict[str, list[float]] = {k: [] for k in kinds}
        for round_ in range(args.rounds):
            for kind, (path, body) in kinds.items():
                for _ in range(5):  # warm
                    await one(path, body)
                c0, t0 = _cpu_s(pid), time.perf_counter()
                for _ in range(args.requests):
                    await one(path, body)
                cpu[kind].append((_cpu_s(pid) - c0) / args.requests * 1e3)
                wall[kind].append((time.perf_counter() - t0) / args.requests * 1e3)
            print(f"round {round_ + 1} of {args.rounds} done", flush=True)
    print(f"gateway CPU per request, ms ({args.requests} requests a round, "
          f"{'streamed' if args.stream else 'whole'}, {args.max_tokens} tokens):")
    for kind in kinds:
        print(f"  {kind:24s} " + " / ".join(f"{v:.2f}" for v in cpu[kind])
              + "   wall " + " / ".join(f"{v:.2f}" for v in wall[kind]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--gateway-pid", type=int, default=0)
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
