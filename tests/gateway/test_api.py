"""The OpenAI-compatible API through the official client, against a scripted engine."""

import asyncio

import aiohttp
import pytest
from openai import AsyncOpenAI, AuthenticationError, NotFoundError

from .conftest import MODEL

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say hello"}]


async def test_chat_non_streaming(client, engine):
    servicer, _ = engine
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, temperature=0.0, seed=7, stop=["\n"], extra_body={"top_k": 5})
    reply = raw.parse()
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == "Hello, world!"
    assert reply.choices[0].finish_reason == "stop"
    # the scripted engine counts one token per word plus one per message
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (6, 4)
    assert reply.usage.total_tokens == 10
    strata = reply.model_extra["strata"]
    assert strata["expert_hit_rate"] == 0.75 and strata["spill_ratio"] == 0.25
    assert strata["decode_tok_s"] == 123.0 and strata["queue_wait_ms"] >= 0
    assert (strata["drafts_accepted"], strata["drafts_proposed"]) == (6, 8)
    assert strata["draft_acceptance_rate"] == 0.75
    assert raw.headers["x-strata-expert-hit-rate"] == "0.75"
    assert float(raw.headers["x-strata-ttft-ms"]) > 0
    sent = servicer.requests[-1]
    assert [(m.role, m.content) for m in sent.chat.messages] == [("system", "be brief"),
                                                               ("user", "say hello")]
    assert sent.sampling.temperature == 0.0 and sent.sampling.top_k == 5
    assert sent.sampling.seed == 7 and list(sent.sampling.stop) == ["\n"]


async def test_chat_max_tokens_and_text_parts(client, engine):
    servicer, _ = engine
    reply = await client.chat.completions.create(
        model=MODEL, max_completion_tokens=2,
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi "},
                                               {"type": "text", "text": "there"}]}])
    assert reply.choices[0].message.content == "Hello,"
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 2
    assert servicer.requests[-1].chat.messages[0].content == "hi there"
    assert servicer.requests[-1].sampling.max_tokens == 2


async def test_chat_streaming(client):
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello, world!"
    assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].model_extra["strata"]["expert_hit_rate"] == 0.75


async def test_chat_streaming_include_usage(client):
    stream = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    last = chunks[-1]
    assert last.choices == []
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (6, 4, 10)
    assert last.model_extra["strata"]["spill_ratio"] == 0.25
    assert chunks[-2].choices[0].finish_reason == "stop"


async def test_stream_wire_format_ends_with_done(gateway):
    body = {"model": MODEL, "messages": MESSAGES, "stream": True}
    async with aiohttp.ClientSession() as http, http.post(
            gateway + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        text = await resp.text()
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert '"chat.completion.chunk"' in events[0]


async def test_completions(client, engine):
    servicer, _ = engine
    reply = await client.completions.create(model=MODEL, prompt="once upon a time", max_tokens=3)
    assert reply.object == "text_completion"
    assert reply.choices[0].text == "Hello, world"
    assert reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (4, 3)
    assert servicer.requests[-1].prompt == "once upon a time"

    stream = await client.completions.create(model=MODEL, prompt="once upon a time", stream=True,
                                             stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello, world!"
    assert chunks[-1].usage.completion_tokens == 4


async def test_models(client):
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert (await client.models.retrieve(MODEL)).id == MODEL
    with pytest.raises(NotFoundError) as info:
        await client.models.retrieve("org/not-served")
    assert (info.value.body["code"], info.value.body["param"]) == ("model_not_found", "model")


async def test_health(gateway):
    async with aiohttp.ClientSession() as http:
        async with http.get(gateway + "/health") as resp:
            assert resp.status == 200
            body = await resp.json()
        async with http.get(gateway + "/health/live") as live:
            assert live.status == 200
    assert body["status"] == "ok"
    assert body["engines"][0]["ready"] is True and body["engines"][0]["model"] == MODEL


async def test_no_engine_gives_503(make_gateway):
    base = await make_gateway(engine_addrs=("127.0.0.1:1",))
    async with aiohttp.ClientSession() as http:
        async with http.get(base + "/health") as resp:
            assert resp.status == 503
            assert (await resp.json())["status"] == "no_engine"
        async with http.post(base + "/v1/chat/completions",
                             json={"model": MODEL, "messages": MESSAGES}) as resp:
            assert resp.status == 503
            assert resp.headers["x-strata-drop-reason"] == "no_engine"
            assert int(resp.headers["Retry-After"]) >= 1
            assert (await resp.json())["error"]["code"] == "no_engine"
        async with http.get(base + "/v1/models") as resp:
            assert resp.status == 503


async def test_request_id_echoed_and_passed_to_engine(gateway, engine):
    servicer, _ = engine
    body = {"model": MODEL, "messages": MESSAGES}
    async with aiohttp.ClientSession() as http:
        async with http.post(gateway + "/v1/chat/completions", json=body,
                             headers={"X-Request-Id": "req-abc.123"}) as resp:
            assert resp.status == 200
            assert resp.headers["X-Request-Id"] == "req-abc.123"
            assert (await resp.json())["id"] == "chatcmpl-req-abc.123"
        assert servicer.requests[-1].request_id == "req-abc.123"
        async with http.post(gateway + "/v1/chat/completions", json=body) as resp:
            generated = resp.headers["X-Request-Id"]
        assert len(generated) >= 16 and servicer.requests[-1].request_id == generated
        async with http.post(gateway + "/v1/chat/completions", json=body,
                             headers={"X-Request-Id": "bad id\twith spaces"}) as resp:
            assert resp.headers["X-Request-Id"] != "bad id\twith spaces"


async def test_api_keys(make_gateway):
    base = await make_gateway(api_keys=frozenset({"sk-good", "sk-other"}))
    async with AsyncOpenAI(base_url=base + "/v1", api_key="sk-good", max_retries=0) as good:
        reply = await good.chat.completions.create(model=MODEL, messages=MESSAGES)
        assert reply.choices[0].message.content == "Hello, world!"
    async with AsyncOpenAI(base_url=base + "/v1", api_key="sk-bad", max_retries=0) as bad:
        with pytest.raises(AuthenticationError) as info:
            await bad.chat.completions.create(model=MODEL, messages=MESSAGES)
        assert info.value.body["code"] == "invalid_api_key"
        with pytest.raises(AuthenticationError):
            await bad.models.list()
    async with aiohttp.ClientSession() as http:
        async with http.post(base + "/v1/chat/completions", json={}) as resp:
            assert resp.status == 401
            assert "missing API key" in (await resp.json())["error"]["message"]
        async with http.get(base + "/health") as resp:  # probes need no key
            assert resp.status == 200


async def test_routes_around_a_dead_engine(make_gateway, engine):
    _, address = engine
    base = await make_gateway(engine_addrs=("127.0.0.1:1", address), max_inflight=1)
    async with AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0) as client:
        replies = await asyncio.gather(*(client.chat.completions.create(
            model=MODEL, messages=MESSAGES) for _ in range(3)))
    assert all(r.choices[0].message.content == "Hello, world!" for r in replies)
    async with aiohttp.ClientSession() as http, http.get(base + "/health") as resp:
        body = await resp.json()
    assert resp.status == 200 and body["capacity"] == 1
    assert [e["ready"] for e in body["engines"]] == [False, True]
