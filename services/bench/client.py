"""The benches' only HTTP/gRPC code: one streamed completion -> an Outcome; engine discovery.

Each request is a streamed `/v1/completions` call with greedy decoding and
`stream_options.include_usage`, so the client sees its own time to first token and the gateway's
final chunk carries usage and the engine's figures (`strata`: decode tok/s, hit rate, spill).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp


@dataclass
class Outcome:
    """One request, as the client saw it. Times are seconds; `start_s` is from the bench start."""

    ok: bool
    status: int
    start_s: float = 0.0
    latency_s: float = 0.0
    ttft_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    text: str = ""
    decode_tok_s: float | None = None  # engine's figure
    client_decode_tok_s: float | None = None  # (n - 1) tokens between first and last chunk
    prefill_tok_s: float | None = None  # prompt tokens / (TTFT minus queue waits)
    hit_rate: float | None = None
    spill_ratio: float | None = None
    queue_wait_ms: float | None = None
    error_code: str | None = None
    error_message: str | None = None
    drop_reason: str | None = None
    retry_after_s: float | None = None

    def to_dict(self, keep_text: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not keep_text:
            d.pop("text")
        return d


def api_base(url: str) -> str:
    """A gateway URL given with or without its /v1 (and trailing slashes) as the API's base."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


class Gateway:
    """An aiohttp session against one gateway base URL (".../v1", or the gateway's root:
    "/v1" is added)."""

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 timeout_s: float = 600.0, origin: float | None = None,
                 keep_alive: bool = True):
        self.base_url = api_base(base_url)
        self.model = model
        self.api_key = api_key
        self.origin = time.perf_counter() if origin is None else origin
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session = aiohttp.ClientSession(
            headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s),
            connector=aiohttp.TCPConnector(limit=0, force_close=not keep_alive))

    async def __aenter__(self) -> Gateway:
        if self.model is None:
            self.model = await self.first_model()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._session.close()

    async def first_model(self) -> str:
        async with self._session.get(f"{self.base_url}/models") as response:
            response.raise_for_status()
            data = (await response.json())["data"]
        if not data:
            raise RuntimeError(f"{self.base_url}/models lists no model")
        return data[0]["id"]

    async def health(self) -> dict | None:
        root = re.sub(r"/v1$", "", self.base_url)
        try:
            async with self._session.get(f"{root}/health") as response:
                return await response.json()
        except (aiohttp.ClientError, json.JSONDecodeError):
            return None

    async def livez(self) -> float:
        """Seconds /livez took to answer (whatever its status)."""
        root = re.sub(r"/v1$", "", self.base_url)
        t0 = time.perf_counter()
        async with self._session.get(f"{root}/livez") as response:
            await response.read()
        return time.perf_counter() - t0

    def completion_body(self, prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
        return {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                **extra}

    async def complete(self, prompt: str, max_tokens: int, **extra: Any) -> Outcome:
        body = self.completion_body(prompt, max_tokens, **extra)
        t0 = time.perf_counter()
        try:
            async with self._session.post(f"{self.base_url}/completions", json=body) as response:
                if response.status != 200:
                    return await _rejected(response, t0, self.origin)
                return await _read_stream(response, t0, self.origin)
        except (TimeoutError, aiohttp.ClientError) as exc:
            return Outcome(False, 0, t0 - self.origin, time.perf_counter() - t0,
                           error_code="client_error", error_message=f"{type(exc).__name__}: {exc}")


async def _rejected(response: aiohttp.ClientResponse, t0: float, origin: float) -> Outcome:
    text = await response.text()
    try:
        error = json.loads(text)["error"]
        code, message = error.get("code"), error.get("message")
    except (json.JSONDecodeError, KeyError, TypeError):
        code, message = None, text[:300]
    retry = response.headers.get("Retry-After")
    return Outcome(False, response.status, t0 - origin, time.perf_counter() - t0,
                   error_code=code, error_message=message,
                   drop_reason=response.headers.get("x-strata-drop-reason"),
                   retry_after_s=float(retry) if retry else None)


async def _read_stream(response: aiohttp.ClientResponse, t0: float, origin: float) -> Outcome:
    out = Outcome(True, 200, t0 - origin)
    parts: list[str] = []
    first_at = last_at = None
    num_chunks = 0
    async for raw in response.content:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            out.ok, out.error_code = False, chunk["error"].get("code") or "stream_error"
            out.error_message = chunk["error"].get("message")
            continue
        for choice in chunk.get("choices", []):
            if choice.get("text"):
                now = time.perf_counter()
                first_at = first_at or now
                last_at = now
                num_chunks += 1
                parts.append(choice["text"])
            if choice.get("finish_reason"):
                out.finish_reason = choice["finish_reason"]
        if chunk.get("usage"):
            out.prompt_tokens = chunk["usage"]["prompt_tokens"]
            out.completion_tokens = chunk["usage"]["completion_tokens"]
        if chunk.get("strata"):
            figures = chunk["strata"]
            out.decode_tok_s = figures.get("decode_tok_s")
            out.hit_rate = figures.get("expert_hit_rate")
            out.spill_ratio = figures.get("spill_ratio")
            out.queue_wait_ms = figures.get("queue_wait_ms", 0.0) + figures.get(
                "engine_queue_ms", 0.0)
    end = time.perf_counter()
    out.latency_s, out.text = end - t0, "".join(parts)
    out.ttft_s = (first_at or end) - t0
    # Tokens after the first over the time between the first and the last: an SSE event may
    # carry several tokens (stream_interval_ms, a client reading slower than the engine), so
    # count them from usage where the stream reports it.
    tokens = out.completion_tokens or num_chunks
    if first_at and last_at and num_chunks > 1 and last_at > first_at:
        out.client_decode_tok_s = (tokens - 1) / (last_at - first_at)
    if out.prompt_tokens:
        busy_s = out.ttft_s - (out.queue_wait_ms or 0.0) / 1e3
        out.prefill_tok_s = out.prompt_tokens / busy_s if busy_s > 0 else None
    if out.finish_reason is None and out.ok:
        out.ok, out.error_code = False, "no_finish"
    return out


# -- the engine behind the gateway ---------------------------------------------------------------


def engine_status(address: str, timeout_s: float = 3.0) -> dict | None:
    """The engine's GetStatus (cache sizing, context window) as a dict; None if unreachable."""
    import grpc

    from services.common.pb.strata.v1 import engine_pb2, engine_pb2_grpc

    try:
        with grpc.insecure_channel(address) as channel:
            s = engine_pb2_grpc.EngineStub(channel).GetStatus(engine_pb2.GetStatusRequest(),
                                                              timeout=timeout_s)
    except grpc.RpcError:
        return None
    c = s.cache
    return {"address": address, "engine_id": s.engine_id, "model": s.model,
            "device": s.device, "context_window": s.context_window, "slots": c.slots,
            "total_pairs": c.total_pairs, "coverage": c.coverage, "slot_bytes": c.slot_bytes,
            "device_memory_bytes": c.device_memory_bytes, "reserved_bytes": c.reserved_bytes,
            "weight_bytes": c.weight_bytes, "kv_bytes": c.kv_bytes,
            "draft_bytes": c.draft_bytes,
            "plan_source": c.plan_source, "plan_version": c.plan_version,
            "requests_finished": s.requests_finished, "tokens_generated": s.tokens_generated,
            "running": s.running, "waiting": s.waiting, "kv_blocks_free": s.kv_blocks_free,
            "kv_blocks_total": s.kv_blocks_total, "lookups": c.decode.lookups, "hits": c.decode.hits,
            "demand_fills": c.decode.fills + c.prefill.fills,
            "prefetch_fills": c.decode.prefetch_fills,
            "distinct_pairs_routed": c.distinct_pairs_routed, "layer_steps": c.layer_steps}


def engine_pid(address: str) -> int | None:
    """The local process listening on the engine's port, if it runs on this machine."""
    import psutil

    try:
        port = int(address.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info.get("cmdline") or [])
        if "engine" not in cmdline:
            continue
        try:
            for conn in proc.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
                    return proc.pid
        except (psutil.AccessDenied, psutil.NoSuchProcess):
            continue
    return None


async def discover(gateway: Gateway) -> dict:
    """The first engine the gateway knows (status + local pid), or {} when none answers."""
    health = await gateway.health() or {}
    for engine in health.get("engines", []):
        address = engine.get("address")
        status = await asyncio.to_thread(engine_status, address) if address else None
        if status:
            status["pid"] = await asyncio.to_thread(engine_pid, address)
            return status
    return {}
