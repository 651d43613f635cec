"""A burst of requests sent at once by a client light enough not to be what is measured.

Every request is built and its connection opened before the first is sent; then all are
written in one tight loop (one syscall each), and each is timed from its own write to the end
of its answer (`latency_s`; `ttft_s`: to its status line). Raw HTTP/1.1 over asyncio streams:
an HTTP client library's per-request work (an aiohttp request costs about 1 ms of this
machine's CPU) would serialize 200 requests into a 200 ms queue inside the client.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from services.bench.client import Outcome


@dataclass
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    request: bytes
    sent_at: float = 0.0


def http_request(url: str, path: str, body: dict[str, Any], api_key: str | None = None) -> bytes:
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    return (f"POST {parts.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n{auth}"
            "\r\n").encode() + payload


def http_get(url: str, path: str) -> bytes:
    parts = urlsplit(url)
    return f"GET {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n\r\n".encode()


async def burst(url: str, requests: list[bytes], origin: float, *,
                settle_s: float = 0.2) -> list[Outcome]:
    """Send every request at once, each on its own kept-alive connection opened `settle_s`
    before (as a pool of clients' connections would be: the burst measures requests, not
    connection set-up); one Outcome each, in order."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    opened = await asyncio.gather(*(asyncio.open_connection(host, port) for _ in requests))
    conns = [_Conn(r, w, raw) for (r, w), raw in zip(opened, requests, strict=True)]
    await asyncio.sleep(settle_s)  # the server accepts them all before the burst
    for c in conns:
        c.writer.write(c.request)
        c.sent_at = time.perf_counter()
    return await asyncio.gather(*(_answer(c, origin) for c in conns))


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    """The response body, by Content-Length or chunked transfer coding."""
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    parts = []
    while size := int((await reader.readline()).split(b";")[0], 16):
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)  # the chunk's CRLF
    await reader.readline()  # the last chunk's CRLF
    return b"".join(parts)


async def _answer(c: _Conn, origin: float) -> Outcome:
    try:
        status_line = await c.reader.readline()
        first = time.perf_counter()
        headers: dict[str, str] = {}
        while (line := await c.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        body = await _body(c.reader, headers)
    except (ConnectionError, OSError, ValueError, asyncio.IncompleteReadError) as exc:
        return Outcome(False, 0, c.sent_at - origin, time.perf_counter() - c.sent_at,
                       error_code="client_error", error_message=f"{type(exc).__name__}: {exc}")
    finally:
        c.writer.close()
    end = time.perf_counter()
    status = int(status_line.split()[1]) if len(status_line.split()) > 1 else 0
    out = Outcome(status == 200, status, c.sent_at - origin, end - c.sent_at,
                  ttft_s=first - c.sent_at)
    if status != 200:
        retry = headers.get("retry-after")
        out.retry_after_s = float(retry) if retry else None
        out.drop_reason = headers.get("x-strata-drop-reason")
        try:
            error = json.loads(body)["error"]
            out.error_code, out.error_message = error.get("code"), error.get("message")
        except (ValueError, KeyError, TypeError):
            out.error_message = body[:300].decode("utf-8", "replace")
        return out
    if b"data: [DONE]" not in body or b'"error":' in body:  # a stream that failed midway
        out.ok, out.error_code = False, "stream_error"
    return out
