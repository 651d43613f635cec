"""Structured output end to end: `strata up` on the default model (whose answers are no JSON on
their own), the official openai client, `response_format` json_schema (strict) over five
schemas: every completed answer parses and validates with jsonschema, streamed or not; the
vLLM-style guided_* fields; an invalid schema is a 400 naming the problem."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from services.models import DEFAULT_MODEL_NAME as MODEL
from tests.e2e.conftest import start_cluster, stop_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 24},
            "address": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 24},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
            "required": ["name", "address"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "enums": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"enum": ["S", "M", "L", "XL"]},
        "in_stock": {"type": "boolean"}},
        "required": ["color", "size", "in_stock"], "additionalProperties": False},
    "arrays": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                 "minItems": 1, "maxItems": 4},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                              "maximum": 100}, "maxItems": 5}},
        "required": ["tags", "scores"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {
        "temperature": {"type": "number", "minimum": -40, "maximum": 60},
        "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
        "pressure": {"type": "number", "exclusiveMinimum": 900, "maximum": 1100}},
        "required": ["temperature", "humidity", "pressure"], "additionalProperties": False},
    "required": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1},
        "title": {"type": "string", "minLength": 1, "maxLength": 30},
        "note": {"type": ["string", "null"], "maxLength": 20}},
        "required": ["id", "title", "note"], "additionalProperties": False},
}
PROMPTS = ["Describe the record.", "def parse_args(argv):", "Give me the data as JSON.",
           "import os", "The weather today"]


@pytest.fixture(scope="module")
def cluster8(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("structured"), "--max-inflight", "8",
                      "--max-queue", "64")
    yield c
    assert stop_cluster(c) == 0, c.output.read_text()[-3000:]


def _format(name: str) -> dict:
    return {"type": "json_schema",
            "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


async def _one(client: openai.AsyncOpenAI, name: str, i: int, stream: bool) -> tuple[str, str]:
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": PROMPTS[i % 5]}],
                  max_tokens=200, temperature=0.8, seed=i, response_format=_format(name))
    if not stream:
        reply = await client.chat.completions.create(**kwargs)
        return reply.choices[0].message.content, reply.choices[0].finish_reason
    text, finish = "", None
    async for chunk in await client.chat.completions.create(**kwargs, stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_50_json_schema_answers_all_parse_and_validate(cluster8, figures, stream):
    async with openai.AsyncOpenAI(base_url=cluster8.base_url, api_key="x",
                                  max_retries=0) as client:
        answers = await asyncio.gather(*(_one(client, name, i, stream)
                                         for i, name in enumerate(list(SCHEMAS) * 10)))
    completed = 0
    for (text, finish), name in zip(answers, list(SCHEMAS) * 10, strict=True):
        assert finish in ("stop", "length"), finish
        if finish == "stop":
            jsonschema.validate(json.loads(text), SCHEMAS[name])
            completed += 1
    figures(f"{completed} of 50 completed (finish 'stop'), every one valid; the rest hit "
            "max_tokens 200")
    assert completed >= 45


async def test_guided_fields_and_json_object(cluster8):
    async with openai.AsyncOpenAI(base_url=cluster8.base_url, api_key="x",
                                  max_retries=0) as client:
        async def complete(**extra):
            reply = await client.completions.create(model=MODEL, prompt="def f(x):",
                                                    max_tokens=48, temperature=0,
                                                    extra_body=extra)
            return reply.choices[0].text, reply.choices[0].finish_reason

        text, finish = await complete(guided_regex=r"[0-9]{3}-[a-z]{2,5}")
        assert finish == "stop" and re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", text), text
        text, finish = await complete(guided_choice=["yes", "no", "maybe later"])
        assert finish == "stop" and text in ("yes", "no", "maybe later"), text
        text, finish = await complete(guided_grammar='start: "x=" NUMBER\nNUMBER: /[0-9]{1,4}/')
        assert finish == "stop" and re.fullmatch(r"x=[0-9]{1,4}", text), text
        text, finish = await complete(guided_json={"type": "array", "items": {"type": "boolean"},
                                                   "minItems": 2, "maxItems": 2})
        assert finish == "stop" and len(json.loads(text)) == 2, text
        reply = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=96,
            temperature=0, response_format={"type": "json_object"})
        if reply.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(reply.choices[0].message.content), dict)


async def test_an_invalid_schema_is_a_400_naming_the_problem(cluster8):
    async with openai.AsyncOpenAI(base_url=cluster8.base_url, api_key="x",
                                  max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                response_format={"type": "json_schema", "json_schema": {
                    "name": "bad", "schema": {"type": "object", "properties": {
                        "n": {"type": "integr"}}}}})
        assert "integr" in caught.value.body["message"], caught.value.body
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model=MODEL, prompt="x", max_tokens=8,
                                            extra_body={"guided_regex": "[a-"})
        assert "regex" in caught.value.body["message"], caught.value.body


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
        "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
        "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _valid_call(call) -> None:
    function = {t["function"]["name"]: t["function"] for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), function["parameters"])
    assert call.type == "function" and call.id.startswith("call_")


async def _streamed_calls(client: openai.AsyncOpenAI, **kwargs) -> tuple[str | None, list]:
    """A streamed chat answer's finish reason and its calls [(name, arguments)], each call's
    deltas joined."""
    calls: dict[int, dict] = {}
    finish = None
    async for chunk in await client.chat.completions.create(**kwargs, stream=True):
        for delta_call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            call = calls.setdefault(delta_call.index, {"name": "", "arguments": ""})
            call["name"] += delta_call.function.name or ""
            call["arguments"] += delta_call.function.arguments or ""
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    return finish, [(c["name"], json.loads(c["arguments"])) for c in calls.values()]


def _calls(message) -> list:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


async def test_required_and_named_tool_choices_always_give_a_valid_call(cluster8, figures):
    async with openai.AsyncOpenAI(base_url=cluster8.base_url, api_key="x",
                                  max_retries=0) as client:
        async def ask(choice, seed):
            return await client.chat.completions.create(
                model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=120,
                temperature=1.0, seed=seed, parallel_tool_calls=False)

        named = {"type": "function", "function": {"name": "get_weather"}}
        replies = await asyncio.gather(*(ask(choice, seed) for seed in range(8)
                                         for choice in ("required", named)))
    names = []
    for reply in replies:
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert len(choice.message.tool_calls) == 1 and not choice.message.content
        _valid_call(choice.message.tool_calls[0])
        names.append(choice.message.tool_calls[0].function.name)
    assert names[1::2] == ["get_weather"] * 8  # the named choice
    figures(f"16 answers with a required or named tool choice, 16 valid calls "
            f"({names.count('add')} add, {names.count('get_weather')} get_weather)")


async def test_streamed_tool_call_deltas_add_up_to_the_same_call(cluster8):
    async with openai.AsyncOpenAI(base_url=cluster8.base_url, api_key="x",
                                  max_retries=0) as client:
        kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                      max_tokens=120, temperature=0, parallel_tool_calls=False)
        whole = (await client.chat.completions.create(**kwargs)).choices[0]
        finish, calls = await _streamed_calls(client, **kwargs)
    assert finish == whole.finish_reason == "tool_calls"
    assert calls == _calls(whole.message)


async def test_auto_parses_a_tool_call_shaped_answer_and_takes_the_results_back(cluster8):
    shaped = ('start: "<tool_call>\\n{\\"name\\": \\"add\\", \\"arguments\\": '
              '{\\"a\\": 2, \\"b\\": 3}}\\n</tool_call>"')
    async with openai.AsyncOpenAI(base_url=cluster8.base_url, api_key="x",
                                  max_retries=0) as client:
        reply = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "2 + 3?"}], tools=TOOLS,
            max_tokens=64, temperature=0, extra_body={"guided_grammar": shaped})
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == (
            "add", {"a": 2, "b": 3})
        follow_up = await client.chat.completions.create(
            model=MODEL, tools=TOOLS, max_tokens=8, temperature=0, messages=[
                {"role": "user", "content": "2 + 3?"},
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "5"}])
        assert follow_up.choices[0].finish_reason in ("stop", "length", "tool_calls")
        plain = await client.chat.completions.create(  # tool_choice none: plain text
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8,
            temperature=0)
        assert plain.choices[0].message.tool_calls is None


async def test_strict_functions_under_auto_answer_text_or_valid_calls(cluster8):
    """function.strict with tool_choice auto (what the OpenAI Agents SDK sends): each answer
    is text that opens no call, or calls that validate; with response_format JSON, the JSON
    or the calls; strict calls and a regex both deciding the output's form is a 400."""
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    async with openai.AsyncOpenAI(base_url=cluster8.base_url, api_key="x",
                                  max_retries=0) as client:
        replies = await asyncio.gather(*(client.chat.completions.create(
            model=MODEL, messages=ASK, tools=strict, max_tokens=48, temperature=1.0,
            seed=seed) for seed in range(6)))
        for reply in replies:
            message = reply.choices[0].message
            for call in message.tool_calls or []:
                _valid_call(call)
            assert "<tool_call>" not in (message.content or ""), message
        formatted = await asyncio.gather(*(client.chat.completions.create(
            model=MODEL, messages=ASK, tools=strict, max_tokens=96, temperature=1.0, seed=seed,
            response_format={"type": "json_object"}) for seed in range(4)))
        for reply in formatted:
            choice = reply.choices[0]
            if choice.finish_reason == "tool_calls":
                for call in choice.message.tool_calls:
                    _valid_call(call)
            elif choice.finish_reason == "stop":
                assert isinstance(json.loads(choice.message.content), dict), choice
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model=MODEL, messages=ASK, tools=strict, max_tokens=8,
                extra_body={"guided_regex": "[a-z]+"})
        assert "strict" in caught.value.body["message"], caught.value.body


def _model_cluster(tmp_path_factory, name: str, make):
    """`strata up` on the checkpoint make(directory) writes, served as `name`."""
    tmp = tmp_path_factory.mktemp(name)
    model = make(tmp / name)
    c = start_cluster(tmp, "--model", str(model), "--max-inflight", "8", "--max-queue", "64")
    yield c
    assert stop_cluster(c) == 0, c.output.read_text()[-3000:]


@pytest.fixture(scope="module")
def glm_cluster(tmp_path_factory):
    """The default model behind GLM-4.5's tool-call template (<arg_key>/<arg_value> lines)."""
    from tests.engine.conftest import glm45_model_dir

    yield from _model_cluster(tmp_path_factory, "glm45", glm45_model_dir)


async def test_glm_s_tool_syntax_gives_valid_calls_whole_streamed_and_in_the_history(
        glm_cluster):
    """With GLM-4.5's template the calls are written and parsed in GLM's own syntax: required
    and named choices are valid calls, streamed deltas add up to the same call, and a
    conversation carrying the call and its result renders (the template iterates the
    arguments as an object)."""
    async with openai.AsyncOpenAI(base_url=glm_cluster.base_url, api_key="x",
                                  max_retries=0) as client:
        kwargs = dict(model="glm45", messages=ASK, tools=TOOLS, max_tokens=120,
                      parallel_tool_calls=False)
        named = {"type": "function", "function": {"name": "get_weather"}}
        replies = await asyncio.gather(*(client.chat.completions.create(
            **kwargs, tool_choice=choice, temperature=1.0, seed=seed)
            for seed in range(4) for choice in ("required", named)))
        for reply in replies:
            choice = reply.choices[0]
            assert choice.finish_reason == "tool_calls", choice
            (call,) = choice.message.tool_calls
            _valid_call(call)
        assert {r.choices[0].message.tool_calls[0].function.name
                for r in replies[1::2]} == {"get_weather"}
        whole = (await client.chat.completions.create(**kwargs, tool_choice="required",
                                                      temperature=0)).choices[0]
        _, streamed = await _streamed_calls(client, **kwargs, tool_choice="required",
                                            temperature=0)
        (call,) = whole.message.tool_calls
        assert streamed == _calls(whole.message)
        follow_up = await client.chat.completions.create(
            model="glm45", tools=TOOLS, max_tokens=8, temperature=0, messages=[
                *ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
        assert follow_up.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.fixture(scope="module")
def harmony_cluster(tmp_path_factory):
    """A tiny random gpt-oss checkpoint with harmony's special tokens and chat template."""
    from tests.engine.conftest import harmony_model_dir

    yield from _model_cluster(tmp_path_factory, "gpt-oss-tiny", harmony_model_dir)


async def test_harmony_answers_split_reasoning_answer_and_calls(harmony_cluster):
    """gpt-oss's harmony through the gateway: the analysis channel comes back as
    reasoning_content and the final channel as content, whole and streamed (the same text);
    a required tool choice is a tool call whose arguments validate."""
    shaped = ('start: <|channel|> "analysis" <|message|> /[a-z]{3,8}/ <|end|> <|start|> '
              '"assistant" <|channel|> "final" <|message|> /[a-z]{3,8}/\n')
    async with openai.AsyncOpenAI(base_url=harmony_cluster.base_url, api_key="x",
                                  max_retries=0) as client:
        kwargs = dict(model="gpt-oss-tiny", messages=ASK, max_tokens=60, temperature=0,
                      extra_body={"guided_grammar": shaped})
        message = (await client.chat.completions.create(**kwargs)).choices[0].message
        assert re.fullmatch("[a-z]{3,8}", message.content), message
        reasoning = message.model_extra["reasoning_content"]
        assert re.fullmatch("[a-z]{3,8}", reasoning), message
        content, thought = "", ""
        async for chunk in await client.chat.completions.create(**kwargs, stream=True):
            if chunk.choices:
                content += chunk.choices[0].delta.content or ""
                thought += (chunk.choices[0].delta.model_extra or {}).get(
                    "reasoning_content") or ""
        assert (content, thought) == (message.content, reasoning)
        kwargs = dict(model="gpt-oss-tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                      max_tokens=160, temperature=1.0, seed=4, parallel_tool_calls=False)
        choice = (await client.chat.completions.create(**kwargs)).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        _valid_call(call)
        # streamed: the call, which the stop token <|call|> closes, comes as a delta too
        finish, streamed = await _streamed_calls(client, **kwargs)
        assert finish == "tool_calls" and streamed == _calls(choice.message)
