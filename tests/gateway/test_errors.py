"""Bad input and engine failures: OpenAI error envelopes, right status codes, service stays up."""

import aiohttp
import grpc
import openai
import pytest

from services.gateway import handlers

from .conftest import MODEL
from .test_overload import BODY, _health, _wait_ready

GOOD = BODY

BAD_BODIES = [
    # (raw body or dict, status, param)
    (b"{not json", 400, None),
    (b"", 400, None),
    ([1, 2], 400, None),
    ({"model": MODEL}, 400, "messages"),
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL, "messages": "hi"}, 400, "messages"),
    ({"messages": GOOD["messages"]}, 400, "model"),
    ({"model": 7, "messages": GOOD["messages"]}, 400, "model"),
    ({"model": "gpt-9", "messages": GOOD["messages"]}, 404, "model"),
    ({"model": MODEL, "messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ({"model": MODEL, "messages": [{"role": "tool", "content": "hi"}]}, 400,
     "messages[0].tool_call_id"),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content[0]"),
    ({**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ({**GOOD, "max_tokens": -5}, 400, "max_tokens"),
    ({**GOOD, "max_tokens": "10"}, 400, "max_tokens"),
    ({**GOOD, "max_completion_tokens": 1.5}, 400, "max_completion_tokens"),
    ({**GOOD, "n": 17}, 400, "n"),  # at most MAX_CHOICES
    ({**GOOD, "temperature": 2.5}, 400, "temperature"),
    ({**GOOD, "temperature": -0.1}, 400, "temperature"),
    ({**GOOD, "temperature": "hot"}, 400, "temperature"),
    ({**GOOD, "top_p": 1.5}, 400, "top_p"),
    ({**GOOD, "top_p": 0}, 400, "top_p"),
    ({**GOOD, "top_k": "many"}, 400, "top_k"),
    ({**GOOD, "seed": -1}, 400, "seed"),
    ({**GOOD, "stop": 5}, 400, "stop"),
    ({**GOOD, "stream": "yes"}, 400, "stream"),
    ({**GOOD, "response_format": {"type": "yaml"}}, 400, "response_format.type"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_BODIES)
async def test_bad_input_gets_envelope_and_service_keeps_serving(gateway, engine, body, status,
                                                                 param):
    servicer, _ = engine
    kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
    async with aiohttp.ClientSession() as http:
        async with http.post(gateway + "/v1/chat/completions", **kwargs) as resp:
            assert resp.status == status
            error = (await resp.json())["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and error["message"]
        assert error["param"] == param
        if status == 404:
            assert error["code"] == "model_not_found"
        assert servicer.requests == []  # bad input never reaches the engine
        async with http.post(gateway + "/v1/chat/completions", json=GOOD) as resp:
            assert resp.status == 200
        health = await _health(http, gateway)
        assert (health["inflight"], health["queued"]) == (0, 0)


async def test_bad_completion_inputs(gateway):
    async with aiohttp.ClientSession() as http:
        for body, param in [({"model": MODEL}, "prompt"),
                            ({"model": MODEL, "prompt": ["a", ""]}, "prompt[1]"),
                            ({"model": MODEL, "prompt": [[1, 2], [3, -4]]}, "prompt[1][1]"),
                            ({"model": MODEL, "prompt": [1, True]}, "prompt[1]"),
                            ({"model": MODEL, "prompt": []}, "prompt"),
                            ({"model": MODEL, "prompt": ["a"] * 9, "n": 2}, "prompt"),
                            ({"model": MODEL, "prompt": "x", "echo": "yes"}, "echo"),
                            ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens")]:
            async with http.post(gateway + "/v1/completions", json=body) as resp:
                assert resp.status == 400, body
                assert (await resp.json())["error"]["param"] == param


async def test_unknown_route_and_method(gateway):
    async with aiohttp.ClientSession() as http:
        async with http.post(gateway + "/v1/embeddings", json={}) as resp:
            assert resp.status == 404
            assert (await resp.json())["error"]["type"] == "invalid_request_error"
        async with http.get(gateway + "/v1/chat/completions") as resp:
            assert resp.status == 405
            assert "error" in await resp.json()
            assert resp.headers["Allow"] == "POST"


@pytest.mark.parametrize("stream", [False, True])
async def test_context_length_exceeded(client, stream):
    long_prompt = "word " * 100
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model=MODEL, stream=stream, messages=[{"role": "user", "content": long_prompt}])
    error = info.value.body
    assert error["code"] == "context_length_exceeded"
    assert "101" in error["message"] and "32" in error["message"]  # both token counts


@pytest.mark.parametrize(("code", "status", "exc_type"), [
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, openai.RateLimitError),
    (grpc.StatusCode.UNAVAILABLE, 503, openai.InternalServerError),
    (grpc.StatusCode.INTERNAL, 500, openai.InternalServerError),
    (grpc.StatusCode.DATA_LOSS, 500, openai.InternalServerError),
])
async def test_engine_status_codes_map_to_http(gateway, client, engine, code, status, exc_type):
    servicer, _ = engine
    servicer.status_code = code
    with pytest.raises(exc_type) as info:
        await client.chat.completions.create(model=MODEL, messages=GOOD["messages"])
    assert info.value.status_code == status
    assert "Traceback" not in info.value.message
    if status in (429, 503):
        assert int(info.value.response.headers["Retry-After"]) >= 1
    servicer.status_code = None
    if code == grpc.StatusCode.UNAVAILABLE:  # routed around until the engine answers a probe
        async with aiohttp.ClientSession() as http:
            await _wait_ready(http, gateway)
    reply = await client.chat.completions.create(model=MODEL, messages=GOOD["messages"])
    assert reply.choices[0].message.content == "Hello, world!"


@pytest.mark.parametrize("failure", ["fail_after", "abort_after"])
async def test_mid_stream_failure_sends_error_event_and_no_done(gateway, engine, failure):
    servicer, _ = engine
    setattr(servicer, failure, 2)
    async with aiohttp.ClientSession() as http:
        async with http.post(gateway + "/v1/chat/completions", json={**GOOD, "stream": True}) as resp:
            assert resp.status == 200
            text = await resp.text()
        events = [e for e in text.split("\n\n") if e]
        assert "[DONE]" not in text
        assert '"content":"Hello"' in events[1]
        assert events[-1].startswith('data: {"error":')
        assert '"finish_reason":"stop"' not in text
        # the same failure without streaming is a 500 envelope
        async with http.post(gateway + "/v1/chat/completions", json=GOOD) as resp:
            assert resp.status == 500
            assert (await resp.json())["error"]["type"] == "server_error"
        health = await _health(http, gateway)
        assert (health["inflight"], health["queued"]) == (0, 0)


async def test_unexpected_gateway_error_is_500_without_traceback(gateway, monkeypatch):
    def broken(body):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(handlers, "parse_chat", broken)
    async with aiohttp.ClientSession() as http, http.post(
            gateway + "/v1/chat/completions", json=GOOD, headers={"X-Request-Id": "boom-1"}) as resp:
        assert resp.status == 500
        error = (await resp.json())["error"]
    assert "secret" not in error["message"] and "boom-1" in error["message"]
    assert error["code"] == "internal_error"
