"""The gaps a streaming client sees between a stream's events: stalls of the whole server
(a collector pause, a step that took a burst of prompts) show in the tail, not in tok/s.

    python scripts/token_gaps.py [--url http://127.0.0.1:8000] [--clients 8] [--requests 60]
                                 [--max-tokens 64]

Against a running `strata up`: each client streams `--requests` completions one after another
(temperature 0, `ignore_eos`); prints the aggregate tok/s and the distribution of the times
between consecutive SSE events of a stream (its first event, which waits for the prompt, not
counted), and how many were over 50 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import aiohttp


async def stream(session: aiohttp.ClientSession, url: str, model: str, prompt: str,
                 max_tokens: int, gaps: list[float]) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}
    last = None
    async with session.post(f"{url}/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if line.startswith(b"data: {"):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now


async def run(a: argparse.Namespace) -> None:
    url = a.url.rstrip("/")
    url = url if url.endswith("/v1") else f"{url}/v1"
    gaps: list[float] = []
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/models") as response:
            model = (await response.json())["data"][0]["id"]

        async def client(c: int) -> None:
            for j in range(a.requests):
                await stream(session, url, model, f"Request {c}.{j}: the expert cache keeps",
                             a.max_tokens, gaps)

        t0 = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(a.clients)))
        wall = time.perf_counter() - t0
    g = sorted(gaps)

    def ms(q: float) -> str:
        return f"{g[min(len(g) - 1, int(len(g) * q))] * 1e3:.1f}"

    print(f"{a.clients} clients x {a.requests} requests of {a.max_tokens} tokens: "
          f"{a.clients * a.requests * a.max_tokens / wall:.0f} tok/s; gaps between a stream's "
          f"events ({len(g)}): p50 {ms(0.5)} p99 {ms(0.99)} p99.9 {ms(0.999)} max "
          f"{g[-1] * 1e3:.1f} ms, {sum(x > 0.05 for x in g)} over 50 ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--max-tokens", type=int, default=64)
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
