"""Aggregate tok/s of an engine's gRPC Generate, no gateway: what the engine's own serving
costs against scripts/engine_rate.py (the engine in process) and `strata bench sweep` (HTTP).

    python scripts/engine_grpc_load.py [--engine 127.0.0.1:50051] [--clients 8]
                                       [--requests-per-client 6] [--max-tokens 64]
                                       [--stream-interval-ms 50] [--rounds 3]

Each of N clients sends Generate calls one after another on one channel (greedy, ignore_eos,
distinct prompts), the way the sweep's clients do over HTTP; prints each round's completion
tokens over its wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import grpc

from services.common.pb.strata.v1 import engine_pb2, engine_pb2_grpc


async def client(stub: engine_pb2_grpc.EngineStub, tag: str, requests: int, max_tokens: int,
                 interval_ms: float) -> int:
    tokens = 0
    for k in range(requests):
        request = engine_pb2.GenerateRequest(
            request_id=f"{tag}-{k}", prompt=f"Request {k} of {tag}: tell me about the sea.",
            sampling=engine_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            stream_interval_ms=interval_ms)
        async for event in stub.Generate(request):
            tokens += len(event.delta.token_ids)
    return tokens


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", default="127.0.0.1:50051")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests-per-client", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--stream-interval-ms", type=float, default=50.0)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    async with grpc.aio.insecure_channel(a.engine) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        await client(stub, "warm-up", 1, 8, a.stream_interval_ms)
        for r in range(a.rounds):
            started = time.perf_counter()
            tokens = sum(await asyncio.gather(*(
                client(stub, f"c{i}-r{r}", a.requests_per_client, a.max_tokens,
                       a.stream_interval_ms) for i in range(a.clients))))
            print(f"round {r + 1}: {a.clients} clients, {tokens / (time.perf_counter() - started):.0f}"
                  f" tok/s", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
