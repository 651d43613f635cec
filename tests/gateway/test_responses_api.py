"""The Responses API (`/v1/responses`) with the official openai client: against the real engine
(its answers equal the chat path's for the same conversation), the scripted one (tool calls,
failures), stored responses (read back, continued, deleted; per API key; through Redis), and a
400 naming each field Strata does not implement."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest

from services.gateway.response_store import LocalResponseStore
from services.gateway.responses_api import SUMMARY_INSTRUCTIONS
from services.gateway.schemas import MAX_MESSAGES

from .conftest import MODEL, real_engine
from .test_overload import _wait_for


def _client(base: str, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0)


async def test_a_response_answers_as_the_chat_path_does(make_gateway, tiny_checkpoint):
    async with real_engine(tiny_checkpoint, "engine-responses") as (address, _, model):
        base = await make_gateway(engine_addrs=(address,))
        async with _client(base) as client:
            kw = {"model": model, "temperature": 0}
            chat = await client.chat.completions.create(
                messages=[{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "the cache keeps"}],
                max_tokens=6, logprobs=True, top_logprobs=2, **kw)
            r = await client.responses.create(
                instructions="Be brief.", input="the cache keeps", max_output_tokens=6,
                include=["message.output_text.logprobs"], top_logprobs=2, **kw)
            stream = await client.responses.create(instructions="Be brief.", stream=True,
                                                   input="the cache keeps", max_output_tokens=6,
                                                   **kw)
            events = [event async for event in stream]
            streamed = events[-1].response
    text = chat.choices[0].message.content
    assert r.output_text == text and r.model == model and r.object == "response"
    assert r.id.startswith("resp_") and r.instructions == "Be brief."
    assert (r.status, r.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert [item.type for item in r.output] == ["message"]
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (
        chat.usage.prompt_tokens, 6, chat.usage.prompt_tokens + 6)
    logprobs = r.output[0].content[0].logprobs
    assert [(lp.token, lp.logprob) for lp in logprobs] == [
        (lp.token, lp.logprob) for lp in chat.choices[0].logprobs.content]
    assert [[t.token for t in lp.top_logprobs] for lp in logprobs] == [
        [t.token for t in lp.top_logprobs] for lp in chat.choices[0].logprobs.content]

    assert streamed.output_text == text and streamed.id != r.id
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[-1].response.usage.output_tokens == 6


async def test_a_stored_response_is_read_back_continued_and_deleted(make_gateway,
                                                                    tiny_checkpoint):
    async with real_engine(tiny_checkpoint, "engine-responses-store") as (address, _, model):
        base = await make_gateway(engine_addrs=(address,))
        async with _client(base) as client:
            kw = {"model": model, "temperature": 0, "max_output_tokens": 5}
            first = await client.responses.create(input="the cache keeps", metadata={"k": "v"},
                                                  **kw)
            assert (await client.responses.retrieve(first.id)).model_dump() == \
                first.model_dump()
            second = await client.responses.create(previous_response_id=first.id,
                                                   input="and then", **kw)
            # the conversation it continued: the first input, its answer, the new input
            chat = await client.chat.completions.create(
                model=model, temperature=0, max_tokens=5,
                messages=[{"role": "user", "content": "the cache keeps"},
                          {"role": "assistant", "content": first.output_text},
                          {"role": "user", "content": "and then"}])
            assert second.output_text == chat.choices[0].message.content
            assert second.previous_response_id == first.id and first.metadata == {"k": "v"}
            assert second.usage.input_tokens == chat.usage.prompt_tokens
            items = await client.responses.input_items.list(second.id)
            assert [(i.role, i.content[0].text) for i in items.data] == [("user", "and then")]
            # the client's own way: pass the output back as input
            by_hand = await client.responses.create(
                input=[{"role": "user", "content": "the cache keeps"}, *first.output,
                       {"role": "user", "content": "and then"}], **kw)
            assert by_hand.output_text == second.output_text

            await client.responses.delete(first.id)
            with pytest.raises(openai.NotFoundError) as gone:
                await client.responses.retrieve(first.id)
            assert gone.value.body["code"] == "not_found"
            with pytest.raises(openai.BadRequestError) as cannot:
                await client.responses.create(previous_response_id=first.id, input="x", **kw)
            assert cannot.value.body["code"] == "previous_response_not_found"
            unstored = await client.responses.create(input="x", store=False, **kw)
            assert unstored.store is False
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve(unstored.id)


async def test_function_calls_come_out_as_items_and_go_back_in_as_messages(engine,
                                                                          make_gateway):
    servicer, _ = engine
    servicer.tool_call_format = "hermes"
    servicer.tokens = ["Checking.", "<tool_call>",
                       '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n',
                       "</tool_call>"]
    tools = [{"type": "function", "name": "get_weather",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    base = await make_gateway()
    async with _client(base) as client:
        r = await client.responses.create(model=MODEL, input="weather in Paris?", tools=tools)
        async with client.responses.stream(model=MODEL, input="weather in Paris?",
                                           tools=tools) as stream:
            kinds = [e.type async for e in stream]
            streamed = await stream.get_final_response()
        call = r.output[1]
        assert [i.type for i in r.output] == ["message", "function_call"]
        assert r.output_text == "Checking." and r.status == "completed"
        assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
        assert r.tools[0].name == "get_weather" and r.tool_choice == "auto"
        assert [i.type for i in streamed.output] == ["message", "function_call"]
        assert "response.function_call_arguments.done" in kinds and kinds[-1] == \
            "response.completed"
        # in the chat path's shape, strict unless the tool says otherwise (OpenAI's default)
        sent = json.loads(servicer.requests[0].chat.tools_json)
        assert sent == [{"type": "function", "function": {
            "name": "get_weather", "parameters": tools[0]["parameters"], "strict": True}}]
        assert r.tools[0].strict is True
        await client.responses.create(model=MODEL, input="hi", tools=[{**tools[0],
                                                                      "strict": False}])
        assert json.loads(servicer.requests[-1].chat.tools_json)[0]["function"]["strict"] is \
            False
        await client.responses.create(model=MODEL, input="hi", tools=[])
        assert not servicer.requests[-1].chat.tools_json

        servicer.tokens = ["Sunny."]
        await client.responses.create(
            model=MODEL, tools=tools, previous_response_id=r.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    messages = servicer.requests[-1].chat.messages
    assert [m.role for m in messages] == ["user", "assistant", "tool"]
    assert messages[1].content == "Checking."
    assert [(c.id, c.name) for c in messages[1].tool_calls] == [(call.call_id, "get_weather")]
    assert (messages[2].tool_call_id, messages[2].content) == (call.call_id, "sunny")


async def test_allowed_tools_reach_the_engine_with_every_tool(engine, make_gateway):
    """tool_choice allowed_tools, in the chat and the Responses shapes: every tool goes to the
    template, and the engine is told which the answer may call."""
    servicer, _ = engine
    weather = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
    ping = {"type": "function", "name": "ping", "parameters": {"type": "object"}}
    base = await make_gateway()
    async with _client(base) as client:
        r = await client.responses.create(model=MODEL, input="hi", tools=[weather, ping],
                                          tool_choice={"type": "allowed_tools", "mode": "auto",
                                                       "tools": [{"type": "function",
                                                                  "name": "ping"}]})
        chat = servicer.requests[-1].chat
        assert [t["function"]["name"] for t in json.loads(chat.tools_json)] == [
            "get_weather", "ping"]
        assert (chat.tool_choice, list(chat.allowed_tools)) == ("auto", ["ping"])
        assert r.tool_choice.type == "allowed_tools"
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}],
            tools=[{"type": "function", "function": {"name": "ping"}},
                   {"type": "function", "function": {"name": "add"}}],
            tool_choice={"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
                {"type": "function", "function": {"name": "add"}}]}})
        chat = servicer.requests[-1].chat
        assert (chat.tool_choice, list(chat.allowed_tools)) == ("required", ["add"])
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(model=MODEL, input="hi", tools=[weather],
                                          tool_choice={"type": "allowed_tools", "mode": "auto",
                                                       "tools": [{"type": "function",
                                                                  "name": "nope"}]})
        assert refused.value.body["param"] == "tool_choice.tools[0].name"


async def test_a_stream_without_obfuscation_is_what_strata_streams(engine, make_gateway):
    base = await make_gateway()
    async with _client(base) as client:
        stream = await client.responses.create(model=MODEL, input="hi", stream=True,
                                               stream_options={"include_obfuscation": False})
        events = [e async for e in stream]
    assert events[-1].type == "response.completed"
    assert all(getattr(e, "obfuscation", None) is None for e in events)


async def test_a_failure_after_the_stream_began_is_response_failed(engine, make_gateway):
    servicer, _ = engine
    servicer.abort_after = 2
    base = await make_gateway()
    async with _client(base) as client:
        stream = await client.responses.create(model=MODEL, input="hi", stream=True)
        events = [e async for e in stream]
    assert events[-1].type == "response.failed"
    assert events[-1].response.status == "failed"
    assert "scripted abort" in events[-1].response.error.message
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        "Hello,"


async def test_responses_are_their_api_keys_own(engine, make_gateway):
    base = await make_gateway(api_keys=frozenset({"key-a", "key-b"}))
    async with _client(base, "key-a") as a, _client(base, "key-b") as b:
        r = await a.responses.create(model=MODEL, input="hi")
        assert (await a.responses.retrieve(r.id)).id == r.id
        with pytest.raises(openai.NotFoundError):
            await b.responses.retrieve(r.id)
        with pytest.raises(openai.BadRequestError) as other:
            await b.responses.create(model=MODEL, input="x", previous_response_id=r.id)
        assert other.value.body["param"] == "previous_response_id"


async def test_gateways_sharing_redis_read_each_others_responses(engine, make_gateway,
                                                                redis_server):
    first = await make_gateway(redis_url=redis_server.url)
    second = await make_gateway(redis_url=redis_server.url)
    async with _client(first) as a, _client(second) as b:
        r = await a.responses.create(model=MODEL, input="hi")
        assert (await b.responses.retrieve(r.id)).output_text == "Hello, world!"
        await b.responses.delete(r.id)
        with pytest.raises(openai.NotFoundError):
            await a.responses.retrieve(r.id)


async def test_the_local_store_keeps_records_for_their_time_and_within_its_bytes():
    now = [0.0]
    store = LocalResponseStore(ttl_s=10.0, max_bytes=200, clock=lambda: now[0])
    await store.put("a", {"owner": "", "response": {"x": 1}})
    assert await store.get("a", "") == {"owner": "", "response": {"x": 1}}
    assert await store.get("a", "someone") is None  # another key's
    now[0] = 10.0
    assert await store.get("a", "") is None  # its time to live is over
    for name in "bcd":
        await store.put(name, {"owner": "", "pad": "x" * 60})
    assert await store.get("b", "") is None and await store.get("d", "") is not None
    assert store.num_bytes <= 200 and store.num_evicted == 1
    await store.put("big", {"owner": "", "pad": "x" * 300})  # over the whole budget
    assert await store.get("big", "") is None and await store.get("d", "") is not None


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "reasoning": {"summary": "brief"}}, "reasoning.summary"),
    ({"input": "x", "reasoning": {"effort": "max"}}, "reasoning.effort"),
    ({"input": "x", "background": True, "store": False}, "background"),
    ({"input": "x", "truncation": "middle"}, "truncation"),
    ({"input": "x", "include": ["file_search_call.results"]}, "include[0]"),
    ({"input": [{"type": "reasoning", "encrypted_content": "gAAAAABo"},
                {"role": "user", "content": "x"}]}, "input[0].encrypted_content"),
    ({"input": [{"type": "reasoning", "encrypted_content": "strata.r1.eJzLSM3JyQcA"},
                {"role": "user", "content": "x"}]}, "input[0].encrypted_content"),
    ({"input": "x", "top_logprobs": 2}, "top_logprobs"),
    ({"input": "x", "stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"input": "x", "stream": True, "stream_options": {"include_obfuscation": True}},
     "stream_options.include_obfuscation"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "extra": 1}]},
     "tools[0].extra"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "g"},
      "tools": [{"type": "function", "name": "f"}]}, "tool_choice.name"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {},
                                        "description": "d"}}}, "text.format.description"),
    ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "output_text", "text": "t"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call_output", "output": "o"}]}, "input[0].call_id"),
    ({"input": "x", "previous_response_id": "chatcmpl-1"}, "previous_response_id"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": []}, "input"),
    ({"input": "\ud800"}, "input"),
])
async def test_a_field_strata_does_not_implement_is_a_400_naming_it(engine, make_gateway, body,
                                                                    param):
    base = await make_gateway()
    async with aiohttp.ClientSession() as http, \
            http.post(base + "/v1/responses", json={"model": MODEL, **body}) as r:
        error = (await r.json())["error"]
    assert (r.status, error["param"]) == (400, param), error
    assert error["type"] == "invalid_request_error"


async def test_input_items_pages_and_unknown_query_parameters(engine, make_gateway):
    base = await make_gateway()
    async with _client(base) as client:
        r = await client.responses.create(model=MODEL, input=[
            {"role": "user", "content": f"m{i}"} for i in range(5)])
        page = await client.responses.input_items.list(r.id, limit=2, order="asc")
        assert [i.content[0].text for i in page.data] == ["m0", "m1"] and page.has_more
        rest = await client.responses.input_items.list(r.id, after=page.last_id, order="asc")
        assert [i.content[0].text for i in rest.data] == ["m2", "m3", "m4"]
        assert not rest.has_more
        newest = await client.responses.input_items.list(r.id)
        assert newest.data[0].content[0].text == "m4"
    async with aiohttp.ClientSession() as http, \
            http.get(f"{base}/v1/responses/{r.id}?stream=true") as got:
        assert (got.status, (await got.json())["error"]["param"]) == (400, "stream")


async def test_text_format_holds_the_output_to_a_schema(make_gateway, tiny_checkpoint):
    from typing import Literal

    from pydantic import BaseModel

    class Verdict(BaseModel):
        mood: Literal["good", "bad"]

    async with real_engine(tiny_checkpoint, "engine-responses-format") as (address, _, model):
        base = await make_gateway(engine_addrs=(address,))
        async with _client(base) as client:
            parsed = await client.responses.parse(model=model, input="how is it?",
                                                  text_format=Verdict, max_output_tokens=40,
                                                  temperature=0)
    assert parsed.status == "completed" and parsed.output_parsed.mood in ("good", "bad")
    assert parsed.text.format.type == "json_schema" and parsed.text.format.strict is True


async def test_a_harmony_answer_is_a_reasoning_item_then_the_message(engine, make_gateway):
    servicer, _ = engine
    servicer.tool_call_format = "harmony"
    servicer.tokens = ["<|channel|>analysis<|message|>", "Think", " hard.", "<|end|>",
                       "<|start|>assistant<|channel|>final<|message|>", "Done."]
    base = await make_gateway(stream_interval_ms=0)
    async with _client(base) as client:
        r = await client.responses.create(model=MODEL, input="hi")
        stream = await client.responses.create(model=MODEL, input="hi", stream=True)
        events = [e async for e in stream]
        servicer.tokens = ["<|channel|>final<|message|>", "Again."]
        await client.responses.create(model=MODEL, input="more", previous_response_id=r.id)
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Think hard." and r.output_text == "Done."
    assert r.usage.output_tokens_details.reasoning_tokens == 2  # "Think hard.", word by word
    assert events[-1].response.output[0].content[0].text == "Think hard."
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == \
        "Think hard."
    history = servicer.requests[-1].chat.messages
    assert [(m.role, m.content, m.reasoning_content) for m in history] == [
        ("user", "hi", ""), ("assistant", "Done.", "Think hard."), ("user", "more", "")]


async def test_reasoning_comes_back_encoded_and_a_stateless_client_sends_it_back(
        engine, make_gateway):
    """include 'reasoning.encrypted_content': a reasoning item carries its text, compressed and
    encoded; a client that keeps no state (store false) sends the item back with that alone,
    and the next prompt has the reasoning as if the turn had been stored."""
    servicer, _ = engine
    servicer.tool_call_format = "harmony"
    servicer.tokens = ["<|channel|>analysis<|message|>", "Think", " hard.", "<|end|>",
                       "<|start|>assistant<|channel|>final<|message|>", "Done."]
    base = await make_gateway(stream_interval_ms=0)
    turn = {"model": MODEL, "store": False, "include": ["reasoning.encrypted_content"]}
    async with _client(base) as client:
        r = await client.responses.create(input="hi", **turn)
        stream = await client.responses.create(input="hi", stream=True, **turn)
        done = [e async for e in stream if e.type == "response.output_item.done"]
        plain = await client.responses.create(input="hi", store=False, model=MODEL)
        token = r.output[0].encrypted_content
        assert token.startswith("strata.r1.") and done[0].item.encrypted_content == token
        assert plain.output[0].encrypted_content is None  # only when asked for
        servicer.tokens = ["<|channel|>final<|message|>", "Again."]
        kept = {"type": "reasoning", "summary": [], "encrypted_content": token}
        await client.responses.create(input=[
            {"role": "user", "content": "hi"}, kept, r.output[1].model_dump(exclude_none=True),
            {"role": "user", "content": "more"}], **turn)
    history = servicer.requests[-1].chat.messages
    assert [(m.role, m.content, m.reasoning_content) for m in history] == [
        ("user", "hi", ""), ("assistant", "Done.", "Think hard."), ("user", "more", "")]


THOUGHT = ["<|channel|>analysis<|message|>", "Think", " hard.", "<|end|>"]
SUMMARY = ["<|channel|>analysis<|message|>", "Short.", "<|end|>",
           "<|start|>assistant<|channel|>final<|message|>", "Thought", " hard."]


def _summaries(request):
    """The scripted engine's answer to a summary request: its own analysis, then the summary."""
    first = request.chat.messages[0] if request.HasField("chat") else None
    return SUMMARY if first is not None and first.content.startswith("Summarize") else None


async def test_reasoning_summary_is_written_by_the_model_before_the_answer_goes_on(
        engine, make_gateway):
    """reasoning.summary: once the reasoning ends, the same engine writes its summary in a
    second, greedy request under the same lease; streamed, the summary's events come between
    the reasoning's and the answer's, as OpenAI orders them; its tokens count as output."""
    servicer, _ = engine
    servicer.tool_call_format = "harmony"
    servicer.tokens = [*THOUGHT, "<|start|>assistant<|channel|>final<|message|>", "Done."]
    servicer.tokens_for = _summaries
    servicer.context_window = 1000
    base = await make_gateway(stream_interval_ms=0)
    async with _client(base) as client:
        plain = await client.responses.create(model=MODEL, input="hi")
        assert plain.output[0].summary == [] and len(servicer.requests) == 1
        r = await client.responses.create(model=MODEL, input="hi",
                                          reasoning={"summary": "auto"})
        asked = servicer.requests[-1]
        assert [i.type for i in r.output] == ["reasoning", "message"]
        assert r.output[0].summary[0].text == "Thought hard." and r.output_text == "Done."
        assert r.output[0].content[0].text == "Think hard." and r.reasoning.summary == "auto"
        assert r.usage.output_tokens == plain.usage.output_tokens + len(SUMMARY)
        assert asked.request_id.endswith("-summary") and asked.chat.reasoning_effort == "low"
        assert [m.content for m in asked.chat.messages] == [
            SUMMARY_INSTRUCTIONS["detailed"], "The reasoning to summarize:\n\nThink hard."]
        assert (asked.sampling.temperature, asked.sampling.max_tokens) == (0.0, 1024)
        async with client.responses.stream(model=MODEL, input="hi",
                                           reasoning={"summary": "concise"}) as stream:
            kinds = [e.type async for e in stream]
            streamed = await stream.get_final_response()
        assert servicer.requests[-1].sampling.max_tokens == 256
        assert servicer.requests[-1].chat.messages[0].content == SUMMARY_INSTRUCTIONS["concise"]
        assert streamed.output[0].summary[0].text == "Thought hard."
        at = {kind: kinds.index(kind) for kind in reversed(kinds)}  # first of each kind
        assert at["response.reasoning_text.delta"] < at["response.reasoning_summary_part.added"]\
            < at["response.reasoning_summary_text.delta"] \
            < at["response.reasoning_summary_text.done"] \
            < at["response.reasoning_summary_part.done"] < at["response.output_text.delta"]
        # a call after the reasoning: the summary comes before it
        servicer.tokens = [*THOUGHT, "<|start|>assistant<|channel|>commentary "
                           "to=functions.f <|constrain|>json<|message|>", "{}"]
        called = await client.responses.create(
            model=MODEL, input="hi", reasoning={"summary": "detailed"},
            tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}])
        assert [i.type for i in called.output] == ["reasoning", "function_call"]
        assert called.output[0].summary[0].text == "Thought hard."
        # the record keeps the summary; the next turn reads the reasoning itself
        again = await client.responses.retrieve(r.id)
        assert again.output[0].summary[0].text == "Thought hard."


async def test_a_store_with_redis_away_keeps_responses_in_the_gateway(engine, make_gateway,
                                                                     redis_server):
    base = await make_gateway(redis_url=redis_server.url)
    redis_server.stop()
    async with _client(base) as client:
        r = await client.responses.create(model=MODEL, input="hi")
        assert (await client.responses.retrieve(r.id)).output_text == "Hello, world!"


async def test_input_tokens_counts_what_a_response_would_report(make_gateway, tiny_checkpoint):
    async with real_engine(tiny_checkpoint, "engine-responses-count") as (address, _, model):
        base = await make_gateway(engine_addrs=(address,))
        tools = [{"type": "function", "name": "f"}]  # the template's tool preamble is long
        async with _client(base) as client:
            kw = {"model": model, "max_output_tokens": 2, "temperature": 0}
            made = []
            for extra in ({}, {"instructions": "Be brief."}, {"tools": tools}):
                counted = await client.responses.input_tokens.count(
                    model=model, input="the cache keeps", **extra)
                made.append(await client.responses.create(input="the cache keeps", **kw, **extra))
                assert counted.object == "response.input_tokens"
                assert counted.input_tokens == made[-1].usage.input_tokens, extra
            first = made[0]
            follow = await client.responses.input_tokens.count(
                input="and then", previous_response_id=first.id)  # model left out: the first
            after = await client.responses.create(input="and then", previous_response_id=first.id,
                                                  **kw)
            assert follow.input_tokens == after.usage.input_tokens > first.usage.input_tokens
            for body, param in (({"input": "x", "stream": True}, "stream"),
                                ({"input": "x", "reasoning": {"summary": "brief"}},
                                 "reasoning.summary"),
                                ({"input": "x", "reasoning": {"effort": "max"}},
                                 "reasoning.effort"),
                                ({"input": [{"type": "item_reference", "id": "m"}]},
                                 "input[0].type")):
                with pytest.raises(openai.BadRequestError) as refused:
                    await client.post("/responses/input_tokens", cast_to=object,
                                      body={"model": model, **body})
                assert refused.value.body["param"] == param


async def test_truncation_auto_leaves_out_the_oldest_turns_that_do_not_fit(engine, make_gateway):
    servicer, _ = engine  # a context window of 32: a message is its words and one more
    words = "one two three four five six seven"
    turns = [{"role": role, "content": f"{role} {words}"}
             for role in ("user", "assistant", "user", "assistant", "user")]  # 9 each: 45
    base = await make_gateway()
    async with _client(base) as client:
        with pytest.raises(openai.BadRequestError) as too_long:
            await client.responses.create(model=MODEL, input=turns)
        assert "context window" in too_long.value.body["message"]
        kw = {"model": MODEL, "input": turns, "truncation": "auto", "instructions": "be brief"}
        r = await client.responses.create(**kw)
        sent = servicer.requests[-1].chat.messages
        # the instructions (3), then the last user turn and what came after: 3 + 9 ... fits
        assert [m.role for m in sent] == ["system", "user", "assistant", "user"]
        assert r.truncation == "auto" and r.usage.input_tokens == 3 + 3 * 9
        counted = await client.responses.input_tokens.count(**kw)
        assert counted.input_tokens == r.usage.input_tokens
        # the record keeps the whole conversation; the next turn is cut again as it needs
        await client.responses.create(model=MODEL, previous_response_id=r.id, input="and?",
                                      truncation="auto")
        sent = servicer.requests[-1].chat.messages
        assert [m.role for m in sent] == ["user", "assistant", "user"]
        assert sent[0].content == "user " + words and sent[-1].content == "and?"
        # a last turn that cannot fit alone goes on, for the engine's 400
        with pytest.raises(openai.BadRequestError):
            await client.responses.create(model=MODEL, truncation="auto",
                                          input=[*turns, {"role": "user",
                                                          "content": "x " * 40}])


async def test_truncation_auto_also_keeps_a_conversation_within_the_message_cap(
        engine, make_gateway):
    """Past MAX_MESSAGES a continued conversation is a 400 naming previous_response_id, and
    with truncation "auto" it loses its oldest turns instead, as past the context window."""
    servicer, _ = engine
    servicer.context_window = 10**6
    base = await make_gateway()
    async with _client(base) as client:
        first = await client.responses.create(
            model=MODEL, input=[{"role": "user", "content": f"u{i}"} for i in range(4000)])
        more = [{"role": "user", "content": f"v{i}"} for i in range(200)]
        with pytest.raises(openai.BadRequestError) as too_many:
            await client.responses.create(model=MODEL, previous_response_id=first.id,
                                          input=more)
        assert too_many.value.body["param"] == "previous_response_id"
        await client.responses.create(model=MODEL, previous_response_id=first.id, input=more,
                                      truncation="auto", instructions="be brief")
        sent = servicer.requests[-1].chat.messages
        assert len(sent) == MAX_MESSAGES and sent[0].role == "system"
        assert [m.content for m in sent[-2:]] == ["v198", "v199"]
        assert sent[1].content == f"u{4000 + 1 + 200 + 1 - MAX_MESSAGES}"  # the oldest kept


async def test_a_conversation_stores_each_turn_once(engine, make_gateway, redis_server):
    """Each record holds its own turn and its ancestors' ids, so records do not grow with the
    conversation; continuing reads the whole chain, and a turn gone from it is a clear 400."""
    import redis.asyncio as aioredis

    servicer, _ = engine
    servicer.context_window = 10**6
    base = await make_gateway(redis_url=redis_server.url)
    r = aioredis.Redis.from_url(redis_server.url)
    async with _client(base) as client:
        ids, previous = [], None
        for turn in range(6):
            made = await client.responses.create(model=MODEL, input=f"turn {turn} " * 20,
                                                 previous_response_id=previous)
            ids.append(previous := made.id)
        sizes = [await r.strlen(f"strata:response:{i}") for i in ids]
        assert max(sizes) < 1.5 * sizes[0], sizes
        messages = servicer.requests[-1].chat.messages
        assert [m.role for m in messages] == ["user", "assistant"] * 5 + ["user"]
        assert messages[0].content.startswith("turn 0") and messages[-1].content.startswith(
            "turn 5")
        await client.responses.delete(ids[2])
        with pytest.raises(openai.BadRequestError) as gone:
            await client.responses.create(model=MODEL, input="more",
                                          previous_response_id=ids[-1])
        assert gone.value.body["code"] == "previous_response_not_found"
        assert ids[2] in gone.value.body["message"]
    await r.aclose()


async def test_continuing_a_conversation_keeps_its_earlier_turns(engine, make_gateway):
    now = [1000.0]
    base = await make_gateway(clock=lambda: now[0], responses_ttl_s=10.0)
    async with _client(base) as client:
        first = await client.responses.create(model=MODEL, input="one")
        now[0] += 8
        second = await client.responses.create(model=MODEL, input="two",
                                               previous_response_id=first.id)
        now[0] += 8  # the first was made 16 s ago, continued 8 s ago: still kept
        await client.responses.create(model=MODEL, input="three",
                                      previous_response_id=second.id)
        now[0] += 11  # nothing continued for 11 s: gone
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first.id)


async def test_an_answer_cut_while_reasoning_counts_its_reasoning(engine, make_gateway):
    servicer, _ = engine
    servicer.tool_call_format = "harmony"
    servicer.tokens = ["<|channel|>analysis<|message|>", "Think", " hard", " and", " long."]
    base = await make_gateway()
    async with _client(base) as client:
        r = await client.responses.create(model=MODEL, input="hi", max_output_tokens=4)
    assert (r.status, [i.type for i in r.output]) == ("incomplete", ["reasoning"])
    assert r.output[0].content[0].text == "Think hard and"
    assert r.usage.output_tokens_details.reasoning_tokens == 3


async def test_each_sampling_and_shape_field_reaches_the_engine(engine, make_gateway):
    servicer, _ = engine
    base = await make_gateway()
    tools = [{"type": "function", "name": "f"}]
    async with _client(base) as client:
        r = await client.responses.create(
            model=MODEL, input="hi", temperature=0.3, top_p=0.5, max_output_tokens=3,
            tools=tools, parallel_tool_calls=False, background=False, user="u-1",
            text={"format": {"type": "json_object"}})
    sent = servicer.requests[-1]
    assert (round(sent.sampling.temperature, 3), sent.sampling.top_p,
            sent.sampling.max_tokens) == (0.3, 0.5, 3)
    assert sent.chat.parallel_tool_calls is False and sent.chat.tool_choice == "auto"
    assert sent.constraint.json_object is True
    assert (r.parallel_tool_calls, r.background, r.user, r.text.format.type) == (
        False, False, "u-1", "json_object")


async def test_a_continuation_waits_in_the_queue_at_its_conversations_size(engine, make_gateway):
    """Admission counts a request's body before reading it; a short body that continues a
    long stored conversation is counted again once its prompt is known, so the queued tokens
    stay under --max-queued-tokens: 429 queue_full where a fresh body of its size would wait."""
    servicer, _ = engine
    servicer.context_window = 10**6
    base = await make_gateway(max_inflight=1, max_queue=4, max_queued_tokens=2000)
    async with _client(base) as client, aiohttp.ClientSession() as http:
        long = await client.responses.create(model=MODEL, input="word " * 4000)  # ~5000 tokens
        servicer.hold = asyncio.Event()
        body = {"model": MODEL, "input": "and?"}
        waiting = [asyncio.create_task(http.post(base + "/v1/responses", json=body))
                   for _ in range(2)]  # one runs, one waits
        await _wait_for(lambda: servicer.running == 1)
        await asyncio.sleep(0.05)
        async with http.post(base + "/v1/responses", json={
                **body, "previous_response_id": long.id}) as refused:
            assert refused.status == 429 and refused.headers["x-strata-drop-reason"] == \
                "queue_full" and int(refused.headers["Retry-After"]) >= 1
            assert "~5" in (await refused.json())["error"]["message"]
        fresh = asyncio.create_task(http.post(base + "/v1/responses", json=body))
        await asyncio.sleep(0.1)
        servicer.hold.set()
        for response in [*(await asyncio.gather(*waiting)), await fresh]:
            assert response.status == 200
            response.release()


async def test_a_coding_agents_turns_as_codex_sends_them(engine, make_gateway):
    """The request an agent such as Codex CLI sends for gpt-oss: instructions, function tools
    that are not strict, no parallel calls, store false, streamed, an empty include and a
    prompt_cache_key; the next turn sends back the reasoning item (encrypted_content null), the
    call and its output as the input, with no previous_response_id."""
    servicer, _ = engine
    servicer.tool_call_format = "harmony"
    servicer.tokens = ["<|channel|>analysis<|message|>", "List the files.", "<|end|>",
                       "<|start|>assistant<|channel|>commentary to=functions.shell "
                       "<|constrain|>json<|message|>", '{"command": ["ls"]}']
    shell = {"type": "function", "name": "shell", "description": "Runs a shell command",
             "strict": False, "parameters": {
                 "type": "object", "properties": {
                     "command": {"type": "array", "items": {"type": "string"}},
                     "workdir": {"type": "string"}, "timeout_ms": {"type": "number"}},
                 "required": ["command"], "additionalProperties": False}}
    turn = {"model": MODEL, "instructions": "You are a coding agent.", "tools": [shell],
            "tool_choice": "auto", "parallel_tool_calls": False, "reasoning": None,
            "store": False, "stream": True, "include": [],
            "prompt_cache_key": "0199b5a4-5f51-7f31-a0ad-3b0a1c9e6d42"}
    user = {"type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "what is here?"}]}
    base = await make_gateway(stream_interval_ms=0)
    async with _client(base) as client:
        stream = await client.responses.create(input=[user], **turn)
        done = [e async for e in stream][-1].response
        reasoning, call = done.output
        assert (reasoning.type, call.type, call.name) == ("reasoning", "function_call", "shell")
        assert json.loads(call.arguments) == {"command": ["ls"]}
        assert done.prompt_cache_key == turn["prompt_cache_key"]
        servicer.tokens = ["<|channel|>final<|message|>", "A README."]
        history = [user, {**reasoning.model_dump(exclude_none=True), "encrypted_content": None},
                   call.model_dump(exclude_none=True),
                   {"type": "function_call_output", "call_id": call.call_id,
                    "output": "README.md"}]
        stream = await client.responses.create(input=history, **turn)
        assert [e async for e in stream][-1].response.output_text == "A README."
    sent = servicer.requests[-1].chat
    assert [(m.role, m.content, m.reasoning_content) for m in sent.messages] == [
        ("system", "You are a coding agent.", ""), ("user", "what is here?", ""),
        ("assistant", "", "List the files."), ("tool", "README.md", "")]
    assert sent.messages[2].tool_calls[0].name == "shell"
    assert json.loads(sent.tools_json)[0]["function"]["strict"] is False
