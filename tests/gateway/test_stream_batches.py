"""The SSE writer: what piled up while the last write was in flight goes out merged, and the
writes that open and end a stream carry what the client needs at once."""

import asyncio
import json
from urllib.parse import urlsplit

import pytest

from services.gateway.engine_client import Delta, Finished, RequestStats
from services.gateway.handlers import _merged


def test_each_choices_deltas_merge_and_keep_their_order_around_finished():
    done = Finished("stop", RequestStats())
    batch = [(0, Delta("a", 1)), (1, Delta("x", 1)), (0, Delta("b", 2)), (0, done),
             (1, Delta("y", 1)), (1, None)]
    assert _merged(batch) == [(0, Delta("ab", 3)), (0, done), (1, Delta("xy", 2)), (1, None)]
    assert _merged([(0, Delta("a", 1))]) == [(0, Delta("a", 1))]


def _http_chunks(raw: bytes) -> tuple[bytes, list[bytes]]:
    """(head, body chunks) of a raw chunked HTTP/1.1 response, each chunk as one write sent it."""
    head, _, body = raw.partition(b"\r\n\r\n")
    chunks = []
    while True:
        size, _, body = body.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            return head, chunks
        chunks.append(body[:n])
        body = body[n + 2:]


async def test_role_chunk_waits_for_the_first_tokens_and_the_last_batch_ends_the_body(
        engine, gateway):
    """Each write is a send and a wake-up of the client: the role chunk goes out with the
    first tokens, and the finish chunk with [DONE] and the body's end, in one write each."""
    servicer, _ = engine
    servicer.tokens, servicer.token_delay_s = ["Hello", "!"], 0.2
    servicer.hold = asyncio.Event()
    url = urlsplit(gateway)
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    body = json.dumps({"model": "tiny-moe", "prompt": "hi", "stream": True}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(body), body))
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200")  # the engine took it: the headers are out
    with pytest.raises(TimeoutError):  # but nothing of the body before the first tokens
        await asyncio.wait_for(reader.read(1), 0.3)
    servicer.hold.set()
    raw = head + await asyncio.wait_for(reader.read(), 5)
    writer.close()
    _, chunks = _http_chunks(raw)
    events = [[json.loads(e) if e != b"[DONE]" else "DONE"
               for e in chunk.removeprefix(b"data: ").split(b"\n\ndata: ")]
              for chunk in (c.removesuffix(b"\n\n") for c in chunks)]
    assert [e["choices"][0]["text"] for e in events[0]] == ["", "Hello"]  # role + first
    assert events[-1][-1] == "DONE" and events[-1][-2]["choices"][0]["finish_reason"] == "stop"
    assert len(chunks) <= 3
