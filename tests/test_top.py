"""`strata top` against a real cache manager (in-process daemon on loopback) and a stub gateway."""

import asyncio
import http.server
import json
import threading

import grpc
import numpy as np
import pytest

from services import top
from services.cachemgr.config import CacheMgrConfig
from services.cachemgr.daemon import start_daemon
from services.common.pb.strata.v1 import cachemgr_pb2, cachemgr_pb2_grpc, counters_pb2
from services.common.redis_server import free_port

HEALTH = {"status": "ok", "engines": [{"address": "e:1", "ready": True}], "inflight": 2,
          "queued": 5, "capacity": 4}


@pytest.fixture
def gateway():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(HEALTH).encode()
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture
async def cachemgr(tmp_path):
    daemon = await start_daemon(CacheMgrConfig.from_values(
        {"port": 0, "metrics_port": 0, "profile_path": tmp_path / "p.bin"}))
    model = cachemgr_pb2.ModelShape(fingerprint="beef", name="tiny-moe", num_layers=2,
                                    num_experts=4, slot_bytes=2**20)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
        stub = cachemgr_pb2_grpc.CacheManagerStub(channel)
        for tokens in (0, 140):  # two reports: the second gives a rate
            await stub.ReportRouting(cachemgr_pb2.RoutingReport(
                engine_id="engine-a", model=model, counts=np.arange(8).tolist(),
                decode=counters_pb2.CacheCounters(lookups=1000, hits=865, misses_host=135),
                tokens_generated=tokens, slots=2,
                device_memory_bytes=6 * 2**20, plan_version=1, requests_running=1,
                requests_waiting=3))
    yield f"127.0.0.1:{daemon.port}"
    await daemon.stop(grace_s=1)


async def test_json_has_engines_model_device_and_gateway(cachemgr, gateway, capsys):
    code = await asyncio.to_thread(top.main, ["--cachemgr", cachemgr, "--gateway", gateway,
                                              "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    (engine,) = data["cachemgr"]["engines"]
    assert engine["engine_id"] == "engine-a" and int(engine["slots"]) == 2
    assert engine["hit_ratio"] == pytest.approx(0.865)
    assert engine["coverage"] == pytest.approx(0.25) and engine["tokens_per_s"] > 0
    assert engine["requests_waiting"] == 3
    (model,) = data["cachemgr"]["models"]
    assert model["model"] == "beef" and model["source"] == "routing-counts"
    assert int(data["cachemgr"]["device"]["memory_total_bytes"]) > 0
    assert data["gateway"] == HEALTH


async def test_one_frame(cachemgr, gateway, capsys):
    assert await asyncio.to_thread(top.main, ["--cachemgr", cachemgr, "--gateway", gateway,
                                              "--once"]) == 0
    frame = capsys.readouterr().out
    assert "\x1b[" not in frame  # no colour when not a terminal
    assert "2 in flight, 5 queued, capacity 4, 1 engine(s) ready" in frame
    header, row = next((line, frame.splitlines()[i + 1])
                       for i, line in enumerate(frame.splitlines()) if line.startswith("ENGINE"))
    assert header.split() == list(top.ENGINE_COLUMNS)
    cells = row.split()
    assert cells[:6] == ["engine-a", "tiny-moe", "2", "25.0%", "86.5%", "13.5%"]  # spilled = lookups - hits
    assert cells[7:9] == ["1", "3"] and cells[9] == "v1"
    assert "device  host" in frame and "routing-counts" in frame


def test_unreachable_cachemgr_is_one_line_and_exit_1(capsys):
    assert top.main(["--cachemgr", f"127.0.0.1:{free_port()}", "--once"]) == 1
    out = capsys.readouterr().out
    assert "UNAVAILABLE" in out and "Traceback" not in out
