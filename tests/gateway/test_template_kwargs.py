"""Chat template variables from the request: vLLM's chat_template_kwargs (Qwen3's
enable_thinking and the like) and OpenAI's reasoning_effort (gpt-oss's), on the chat path, the
Responses API and /tokenize, each refused by name where the model's template does not read it."""

from __future__ import annotations

import json
import shutil

import aiohttp
import openai
import pytest

from .conftest import real_engine

PREAMBLE = ("{%- if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}\n"
            "{%- endif %}{%- if enable_thinking is defined and not enable_thinking %}"
            "/no_think\n{%- endif %}")


@pytest.fixture(scope="module")
def thinking_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint with a template that reads reasoning_effort and enable_thinking."""
    path = tmp_path_factory.mktemp("ckpt") / "thinking"
    shutil.copytree(tiny_checkpoint, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = PREAMBLE + config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


async def _post(http, url, body):
    async with http.post(url, json=body) as r:
        return r.status, await r.json()


async def test_template_variables_reach_the_template_and_the_count(make_gateway,
                                                                  thinking_checkpoint):
    messages = [{"role": "user", "content": "the cache keeps"}]
    async with real_engine(thinking_checkpoint, "engine-kwargs") as (address, _, model):
        base = await make_gateway(engine_addrs=(address,))
        async with aiohttp.ClientSession() as http, openai.AsyncOpenAI(
                base_url=base + "/v1", api_key="unused", max_retries=0) as client:
            async def prompt(**extra):
                status, ids = await _post(http, base + "/tokenize",
                                          {"messages": messages, **extra})
                assert status == 200, ids
                _, text = await _post(http, base + "/detokenize", {"tokens": ids["tokens"]})
                return ids["count"], text["prompt"]

            plain_count, plain = await prompt()
            _, no_think = await prompt(chat_template_kwargs={"enable_thinking": False})
            effort_count, effort = await prompt(chat_template_kwargs={"reasoning_effort": "high"})
            assert "/no_think" in no_think and "/no_think" not in plain
            assert effort.startswith("Reasoning: high") and not plain.startswith("Reasoning")

            kw = {"model": model, "max_tokens": 2, "temperature": 0}
            chat = await client.chat.completions.create(messages=messages,
                                                        reasoning_effort="high", **kw)
            assert chat.usage.prompt_tokens == effort_count > plain_count
            thinking_off = await client.chat.completions.create(
                messages=messages, extra_body={"chat_template_kwargs": {"enable_thinking":
                                                                        False}}, **kw)
            assert thinking_off.usage.prompt_tokens > plain_count

            r = await client.responses.create(model=model, input="the cache keeps",
                                              reasoning={"effort": "high"},
                                              max_output_tokens=2)
            assert r.reasoning.effort == "high" and r.usage.input_tokens == effort_count
            counted = await client.responses.input_tokens.count(
                model=model, input="the cache keeps", reasoning={"effort": "high"})
            assert counted.input_tokens == effort_count

            for body, param in (
                    ({"chat_template_kwargs": {"foo": 1}}, "chat_template_kwargs.foo"),
                    ({"chat_template_kwargs": {"messages": []}},
                     "chat_template_kwargs.messages"),
                    ({"chat_template_kwargs": {"reasoning_effort": "low"},
                      "reasoning_effort": "high"}, "reasoning_effort"),
                    ({"chat_template_kwargs": {"bad name": 1}},
                     "chat_template_kwargs.bad name"),
                    ({"reasoning_effort": "extreme"}, "reasoning_effort")):
                status, error = await _post(http, base + "/v1/chat/completions",
                                            {"model": model, "messages": messages, **body})
                assert (status, error["error"]["param"]) == (400, param), (body, error)
            status, error = await _post(http, base + "/tokenize", {
                "messages": messages, "chat_template_kwargs": {"foo": 1}})
            assert (status, error["error"]["param"]) == (400, "chat_template_kwargs.foo")


async def test_a_template_without_the_variable_refuses_it(make_gateway, tiny_checkpoint):
    async with real_engine(tiny_checkpoint, "engine-no-kwargs") as (address, _, model):
        base = await make_gateway(engine_addrs=(address,))
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused",
                                      max_retries=0) as client:
            with pytest.raises(openai.BadRequestError) as chat:
                await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "hi"}],
                    reasoning_effort="low", max_tokens=2)
            with pytest.raises(openai.BadRequestError) as responses:
                await client.responses.create(model=model, input="hi",
                                              reasoning={"effort": "low"})
    assert (chat.value.body["param"], chat.value.body["code"]) == (
        "reasoning_effort", "unsupported_parameter")
    assert "no reasoning effort" in chat.value.body["message"]
    assert responses.value.body["param"] == "reasoning.effort"
