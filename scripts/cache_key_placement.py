"""What prompt_cache_key buys a deployment of several engines: conversations whose turns reach
the engine that holds their prefix, against turns placed by load alone.

    python scripts/cache_key_placement.py [--model DIR] [--conversations 8] [--turns 6]
                                          [--rounds 3]

Starts two engines (one thread each) and a gateway in front of both, then runs the same
conversations in rounds, alternating: without a key (every turn goes to the least loaded
engine) and with `prompt_cache_key` set to the conversation's id. The conversations run at
once, each turn sent when the one before it has answered, with its whole history. Prints, per
mode and round, the share of the prompt tokens of every turn after the first that the engine
reused from its prefix cache (`usage.prompt_tokens_details.cached_tokens`), the tokens a turn
had prefilled (its prompt less what was reused), and the turns' median time to the answer.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from openai import AsyncOpenAI

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ["How does the list type grow when items are appended?",
             "And what does the dict type do when it fills up?",
             "Which of the two is faster to iterate over?",
             "How would you measure that with timeit?",
             "What would change for a set?",
             "Summarize the differences in two lines."]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _ready(base: str, engines: int, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            try:
                async with http.get(base + "/readyz") as r:
                    body = await r.json()
                    if sum(e.get("ready", False) for e in body.get("engines", [])) == engines:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise SystemExit(f"the gateway at {base} did not see {engines} ready engines in "
                     f"{timeout_s:.0f} s")


async def _conversation(client: AsyncOpenAI, model: str, name: str, turns: int,
                        keyed: bool) -> list[tuple[int, int, float]]:
    """(prompt tokens, cached tokens, seconds) a turn."""
    messages: list[dict[str, str]] = [{"role": "system",
                                       "content": f"You are assistant {name}. Be brief."}]
    out = []
    for turn in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        started = time.perf_counter()
        answer = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=24, temperature=0,
            extra_body={"prompt_cache_key": name} if keyed else None)
        took = time.perf_counter() - started
        usage = answer.usage
        details = usage.prompt_tokens_details
        out.append((usage.prompt_tokens, details.cached_tokens if details else 0, took))
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})
    return out


async def _round(base: str, model: str, conversations: int, turns: int, keyed: bool,
                 tag: str) -> tuple[float, float, float]:
    async with AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0) as client:
        results = await asyncio.gather(*(
            _conversation(client, model, f"{tag}-{i}", turns, keyed)
            for i in range(conversations)))
    later = [t for turns_ in results for t in turns_[1:]]  # the first turn has no prefix yet
    reused = sum(c for _, c, _ in later) / max(1, sum(p for p, _, _ in later))
    prefilled = statistics.mean(p - c for p, c, _ in later)
    return reused, prefilled, statistics.median(s for _, _, s in later)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the shipped model)")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="strata-placement-"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ports = [_free_port() for _ in range(2)]
    procs = []

    def start(cmd: list[str], name: str) -> None:
        with open(logs / f"{name}.log", "w") as out:  # the child keeps its own descriptor
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))

    try:
        for i, port in enumerate(ports):
            cmd = [sys.executable, "-m", "services.engine", "--port", str(port), "--threads",
                   "1", "--metrics-port", str(_free_port()), "--engine-id", f"engine-{i}"]
            start(cmd + (["--model", a.model] if a.model else []), f"engine-{i}")
        gateway_port = _free_port()
        start([sys.executable, "-m", "services.gateway", "--port", str(gateway_port),
               "--engine", ",".join(f"127.0.0.1:{port}" for port in ports)], "gateway")
        base = f"http://127.0.0.1:{gateway_port}"
        print(f"two engines and a gateway at {base} (logs in {logs}); waiting for both "
              "engines...", file=sys.stderr, flush=True)
        asyncio.run(_ready(base, 2))

        async def model_name() -> str:
            async with AsyncOpenAI(base_url=base + "/v1", api_key="unused") as client:
                return (await client.models.list()).data[0].id

        model = asyncio.run(model_name())
        asyncio.run(_round(base, model, 2, 2, True, "warm-up"))
        print(f"{a.conversations} conversations x {a.turns} turns at once, two engines:")
        print("| round | placement | prompt tokens reused (turns 2+) | tokens prefilled a turn "
              "(mean) | time a turn p50 |")
        print("|---|---|---|---|---|")
        for r in range(a.rounds):
            for keyed in (False, True):
                reused, prefilled, p50 = asyncio.run(_round(base, model, a.conversations, a.turns, keyed,
                                                 f"r{r}-{'key' if keyed else 'load'}"))
                label = "prompt_cache_key" if keyed else "least loaded"
                print(f"| {r + 1} | {label} | {reused:.1%} | {prefilled:.1f} | "
                      f"{p50 * 1e3:.0f} ms |", flush=True)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
