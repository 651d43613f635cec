"""CPU per message of a grpc.aio server stream of small messages, server and client apart.

    python scripts/grpc_stream_cost.py [--messages 300] [--pace-ms 0 10]

A `Generate` servicer yields one-token `TokenDelta` messages, `--pace-ms` apart, to an aio client
in another process; each side reports its process CPU time per message. What it shows: the cost
of a message depends on whether the event loops idle between messages (paced) or not (back to
back), which is why the engine sends one message per step per request and batches the loop's
wake-ups (docs/benchmarks.md, "The serving path").
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from services.common.pb.strata.v1 import engine_pb2, engine_pb2_grpc  # noqa: E402


class _Servicer(engine_pb2_grpc.EngineServicer):
    def __init__(self, messages: int, pace_s: float):
        self.messages, self.pace_s = messages, pace_s

    async def Generate(self, request, context):  # noqa: N802 - the proto's name
        cpu = time.process_time()
        for i in range(self.messages):
            yield engine_pb2.GenerateEvent(delta=engine_pb2.TokenDelta(text="abc", token_ids=[i]))
            if self.pace_s:
                await asyncio.sleep(self.pace_s)
        print(f"server: {(time.process_time() - cpu) / self.messages * 1e6:.0f} us CPU/message",
              flush=True)


async def _serve(port: int, messages: int, pace_s: float) -> None:
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServicer_to_server(_Servicer(messages, pace_s), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def _read(port: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await channel.channel_ready()
        cpu, n = time.process_time(), 0
        async for _ in engine_pb2_grpc.EngineStub(channel).Generate(engine_pb2.GenerateRequest()):
            n += 1
        print(f"client: {(time.process_time() - cpu) / n * 1e6:.0f} us CPU/message", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=300)
    p.add_argument("--pace-ms", type=float, nargs="+", default=[0.0, 10.0])
    p.add_argument("--port", type=int, default=50999)
    p.add_argument("--role", choices=("server", "client"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.role == "server":
        asyncio.run(_serve(a.port, a.messages, a.pace_ms[0] / 1e3))
        return
    if a.role == "client":
        asyncio.run(_read(a.port))
        return
    for pace in a.pace_ms:
        print(f"{a.messages} messages, {pace:g} ms apart:", flush=True)
        server = subprocess.Popen([sys.executable, __file__, "--role", "server", "--port",
                                   str(a.port), "--messages", str(a.messages), "--pace-ms",
                                   str(pace)])
        try:
            time.sleep(1.5)
            subprocess.run([sys.executable, __file__, "--role", "client", "--port", str(a.port)],
                           check=True)
            time.sleep(0.3)  # the server's line
        finally:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()
