"""SIGTERM on a real gateway process: readiness fails at once, new requests get 503 draining,
the running stream finishes with [DONE], then the process exits 0."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from services.common.redis_server import free_port

from .test_overload import BODY, _wait_for

ROOT = Path(__file__).resolve().parents[2]


async def _until_ready(http, base, process, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        assert process.poll() is None, process.stdout.read()
        try:
            async with http.get(base + "/readyz") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        assert time.monotonic() < deadline, "the gateway did not become ready"
        await asyncio.sleep(0.1)


async def test_sigterm_drains_then_exits(engine):
    servicer, address = engine
    servicer.tokens, servicer.token_delay_s = ["tok"] * 40, 0.1  # a 4 s stream
    port = free_port()
    env = {**os.environ, "STRATA_REDIS_URL": "", "STRATA_API_KEYS": ""}
    process = subprocess.Popen(
        [sys.executable, "-m", "services.gateway", "--port", str(port), "--engine", address,
         "--drain-timeout-s", "10", "--metrics-port", "0"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            await _until_ready(http, base, process)
            async with http.post(base + "/v1/chat/completions",
                                 json={**BODY, "stream": True}) as stream:
                await stream.content.readuntil(b"\n\n")
                await _wait_for(lambda: servicer.running == 1)
                process.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + 3.0
                while True:  # the signal reaches the gateway's loop within a moment
                    async with http.get(base + "/readyz") as resp:
                        if resp.status == 503:
                            assert (await resp.json())["status"] == "draining"
                            break
                    assert time.monotonic() < deadline, "readiness did not fail after SIGTERM"
                    await asyncio.sleep(0.02)
                async with http.post(base + "/v1/chat/completions", json=BODY) as resp:
                    assert resp.status == 503
                    assert resp.headers["x-strata-drop-reason"] == "draining"
                    assert int(resp.headers["Retry-After"]) >= 1
                text = (await stream.read()).decode()
            assert text.rstrip().endswith("data: [DONE]")
        assert await asyncio.to_thread(process.wait, 10) == 0
        output = process.stdout.read()
        assert "draining" in output and "drained" in output
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


async def test_sigterm_lets_a_background_response_finish_and_store_itself(engine,
                                                                          redis_server):
    """A background response holds its admission ticket: the drain waits for it, and its end
    is in the shared store when the process has exited."""
    import json

    import redis.asyncio as aioredis

    from services.gateway.response_store import KEY_PREFIX

    servicer, address = engine
    servicer.tokens, servicer.token_delay_s = ["tok"] * 20, 0.1  # a 2 s answer
    port = free_port()
    env = {**os.environ, "STRATA_REDIS_URL": redis_server.url, "STRATA_API_KEYS": ""}
    process = subprocess.Popen(
        [sys.executable, "-m", "services.gateway", "--port", str(port), "--engine", address,
         "--drain-timeout-s", "10", "--metrics-port", "0"], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            await _until_ready(http, base, process)
            async with http.post(base + "/v1/responses", json={
                    "model": BODY["model"], "input": "hi", "background": True}) as resp:
                queued = await resp.json()
            assert queued["status"] == "queued"
            await _wait_for(lambda: servicer.running == 1)
            process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(process.wait, 10) == 0
        r = aioredis.Redis.from_url(redis_server.url)
        stored = json.loads(await r.get(KEY_PREFIX + queued["id"]))["response"]
        await r.aclose()
        assert stored["status"] == "completed"
        assert stored["output"][0]["content"][0]["text"] == "tok" * 20
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
