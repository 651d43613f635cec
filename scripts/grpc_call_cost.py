"""CPU per request of a grpc.aio call against one long-lived stream, server and client apart.

    python scripts/grpc_call_cost.py [--requests 1000] [--rounds 3]

A server in another process answers each request with three small messages (what a short
Generate returns: Started, a delta, Finished), either as its own unary-stream call (how the
gateway calls an engine) or on one bidirectional stream that carries every request and reply in
turn. The client reports its process CPU time per request. What it shows: a call costs its client
about 1 ms of CPU on a small host, whatever its metadata or deadline, and a stream's request
about half of that (docs/benchmarks.md, "Where the rest of a request goes").
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

import grpc

SERVICE = "strata.bench.Cost"
REPLIES = (b"started", b"delta", b"finished")


async def _serve(port: int) -> None:
    async def call(request: bytes, context: grpc.aio.ServicerContext):
        for reply in REPLIES:
            yield reply

    async def stream(requests, context: grpc.aio.ServicerContext):
        async for _ in requests:
            for reply in REPLIES:
                yield reply

    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {
        "Call": grpc.unary_stream_rpc_method_handler(call),
        "Stream": grpc.stream_stream_rpc_method_handler(stream)})])
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def _client(port: int, requests: int, rounds: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await channel.channel_ready()
        method = channel.unary_stream(f"/{SERVICE}/Call")
        stream = channel.stream_stream(f"/{SERVICE}/Stream")()
        request = b"x" * 200
        metadata = (("x-request-id", "0" * 32),)

        async def by_call() -> None:
            async for _ in method(request, metadata=metadata, timeout=600.0):
                pass

        async def on_stream() -> None:
            await stream.write(request)
            for _ in REPLIES:
                await stream.read()

        for r in range(rounds):
            for name, one in (("own call", by_call), ("one stream", on_stream)):
                for _ in range(50):  # warm
                    await one()
                cpu, wall = time.process_time(), time.perf_counter()
                for _ in range(requests):
                    await one()
                print(f"round {r + 1}, {name}: client {(time.process_time() - cpu) / requests * 1e6:.0f}"
                      f" us CPU/request, {(time.perf_counter() - wall) / requests * 1e6:.0f} us wall",
                      flush=True)
        await stream.done_writing()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--port", type=int, default=50998)
    p.add_argument("--role", choices=("server",), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.role == "server":
        asyncio.run(_serve(a.port))
        return
    server = subprocess.Popen([sys.executable, __file__, "--role", "server", "--port",
                               str(a.port)])
    try:
        time.sleep(1.5)
        asyncio.run(_client(a.port, a.requests, a.rounds))
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
