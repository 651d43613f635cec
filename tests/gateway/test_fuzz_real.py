"""Property-based fuzzing of the real path: the gateway in front of the real engine (a tiny
checkpoint behind its gRPC server on loopback). Bodies are built from every field of the served
OpenAPI schema, and bytes are made hostile: lone surrogates, invalid UTF-8, deep nesting,
numbers past any limit, NaN/Infinity, 1 MB strings, truncated JSON. Whatever arrives: never a
5xx, every error in the OpenAI envelope, every admitted request ends, and afterwards the server
is healthy with every KV block free."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from .conftest import real_engine

PATHS = ("/v1/chat/completions", "/v1/completions")
ENVELOPE = {"message", "type", "param", "code"}


@pytest.fixture
async def real(tiny_checkpoint, make_gateway):
    """(gateway URL, the engine core, the model's name, every request field of the schema)."""
    async with real_engine(tiny_checkpoint, "engine-fuzz") as (address, engine, model):
        url = await make_gateway(engine_addrs=(address,))
        async with aiohttp.ClientSession() as http, http.get(url + "/openapi.json") as r:
            schemas = (await r.json())["components"]["schemas"]
        fields = sorted(set(schemas["ChatCompletionRequest"]["properties"])
                        | set(schemas["CompletionRequest"]["properties"]))
        yield url, engine, model, fields


HOSTILE_TEXT = st.sampled_from([
    "\ud800", "a\udfffb", "\ud83d", "\x00", "\u202e", "\ufeff", "", " ", "\n" * 3,
    "x" * 1_000_000,  # a 1 MB string
])
HOSTILE_NUMBERS = st.sampled_from([
    10**400, -(10**400), 2**63, 2**64, -1, 0, 1e308, -1e308, 5e-324, 1.5, 2**31, 2**31 - 1,
])
scalars = (st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
           | st.floats() | st.text(st.characters(codec=None), max_size=12) | HOSTILE_TEXT
           | HOSTILE_NUMBERS)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                           max_leaves=8)
message = st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["system", "developer", "user", "assistant", "tool", ""])
    | json_values, "content": st.text(max_size=20) | HOSTILE_TEXT | json_values})


@st.composite
def bodies(draw, model: str, fields: list[str], path: str) -> dict:
    """A valid short request for `path` with some of the schema's fields set to anything."""
    body = {"model": model, "max_tokens": 4} | (
        {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path
        else {"prompt": "once"})
    for key in draw(st.lists(st.sampled_from(fields), max_size=4, unique=True)):
        body[key] = draw(st.lists(message, max_size=3) | json_values if key == "messages"
                         else json_values)
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
        body["max_tokens"] = min(body["max_tokens"], 64)  # a long answer proves nothing more
    return body


def _text(body: dict) -> str:
    # ensure_ascii keeps lone surrogates as \\udXXX escapes: valid JSON, invalid Unicode
    return json.dumps(body, ensure_ascii=True, allow_nan=True)


@st.composite
def payloads(draw, model: str, fields: list[str]) -> tuple[str, bytes]:
    path = draw(st.sampled_from(PATHS))
    return path, draw(_bytes(model, fields, path))


@st.composite
def _bytes(draw, model: str, fields: list[str], path: str) -> bytes:
    body = draw(bodies(model, fields, path))
    kind = draw(st.sampled_from(["json", "json", "json", "truncated", "bad_utf8", "nested",
                                 "constants", "digits", "bare"]))
    text = _text(body)
    if kind == "truncated":
        return text[:draw(st.integers(0, len(text) - 1))].encode()
    if kind == "bad_utf8":  # raw bytes that are no UTF-8, inside a string value
        cut = text.index('"', text.index('"model"') + 8) + 1
        return text[:cut].encode() + draw(st.sampled_from(
            [b"\xff", b"\xc3(", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x80"])) + \
            text[cut:].encode()
    if kind == "nested":
        depth = draw(st.sampled_from([64, 1000, 5000, 100_000]))
        key = draw(st.sampled_from(["messages", "stop", "logit_bias", "prompt"]))
        return text[:-1].encode() + f', "{key}": '.encode() + b"[" * depth + b"]" * depth + b"}"
    if kind == "constants":
        key = draw(st.sampled_from(["temperature", "top_p", "max_tokens", "seed", "min_p"]))
        value = draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-1e400"]))
        return text[:-1].encode() + f', "{key}": {value}}}'.encode()
    if kind == "digits":  # an integer longer than Python's default digit limit
        key = draw(st.sampled_from(["max_tokens", "seed", "n", "top_k"]))
        return text[:-1].encode() + f', "{key}": {"9" * 5000}}}'.encode()
    if kind == "bare":
        return draw(st.sampled_from([b"", b"null", b"[]", b'"hi"', b"1", b"{", b"\x00" * 8]))
    return text.encode()


async def _post(http: aiohttp.ClientSession, url: str, data: bytes) -> tuple[int, bytes]:
    async with http.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.read()


def _check(status: int, raw: bytes, streamed: bool) -> None:
    assert status < 500, raw[:2000]
    if status >= 400:
        error = json.loads(raw)["error"]
        assert set(error) == ENVELOPE and error["message"], error
        return
    if not streamed:
        reply = json.loads(raw)
        assert reply["choices"] and reply["usage"]["completion_tokens"] >= 0
        return
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert events and (events[-1] == "[DONE]" or "error" in json.loads(events[-1])), events[-3:]
    for event in events[:-1]:
        payload = json.loads(event)
        if "error" in payload:  # an error event is the stream's last word
            assert set(payload["error"]) == ENVELOPE


async def test_the_real_path_never_answers_5xx_and_ends_healthy(real):
    url, engine, model, fields = real
    assert {"logit_bias", "stop_token_ids", "stream_options", "n"} <= set(fields)
    seen: dict[str, int] = {}

    loop = asyncio.get_running_loop()

    async def check(data_bytes: bytes, path: str) -> None:
        async with aiohttp.ClientSession() as http:
            status, raw = await _post(http, url + path, data_bytes)
        seen[str(status)] = seen.get(str(status), 0) + 1
        try:
            streamed = json.loads(data_bytes).get("stream") is True
        except (ValueError, AttributeError, RecursionError):
            streamed = False
        _check(status, raw, streamed and status == 200)

    # Hypothesis drives a plain function: it runs in a worker thread and hands each example to
    # this test's event loop, where the gateway and the engine's server live.
    @settings(max_examples=150, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(payload=payloads(model, fields))
    @example(payload=("/v1/chat/completions", json.dumps(  # found by this test: a 500 once
        {"model": model, "messages": [{"role": "user", "content": "hi"}],
         "frequency_penalty": 10**400}).encode()))
    @example(payload=("/v1/completions", json.dumps(
        {"model": model, "prompt": "x", "logit_bias": {"1" * 60: 1}, "temperature": -10**300,
         "max_tokens": -(10**400)}).encode()))
    def one(payload: tuple[str, bytes]) -> None:
        path, data_bytes = payload
        asyncio.run_coroutine_threadsafe(check(data_bytes, path), loop).result(120)

    await asyncio.to_thread(one)
    assert seen.get("200", 0) >= 5 and seen.get("400", 0) >= 50, seen  # both ways were tried
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/readyz") as r:
            state = await r.json()
        assert r.status == 200 and (state["inflight"], state["queued"]) == (0, 0), state
        status, raw = await _post(http, url + "/v1/completions", json.dumps(
            {"model": model, "prompt": "def f", "max_tokens": 3, "ignore_eos": True}).encode())
        assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 3
    assert (engine.num_running, engine.num_waiting) == (0, 0)
    blocks = engine.scheduler.blocks
    assert blocks.num_free_blocks == blocks.num_blocks, "KV blocks left allocated after the fuzzing"
