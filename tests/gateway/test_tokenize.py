"""vLLM's tokenizer endpoints (/tokenize, /detokenize, /tokenizer_info), answered by the real
engine's tokenizer through the gateway, as lm-evaluation-harness's remote tokenizer uses them."""

from __future__ import annotations

import aiohttp
import openai

from .conftest import real_engine


async def _post(http, url, body):
    async with http.post(url, json=body) as r:
        return r.status, await r.json()


async def test_tokenizer_endpoints_answer_with_the_engines_own_tokenizer(
        make_gateway, tiny_checkpoint):
    async with real_engine(tiny_checkpoint, "engine-tokenize") as (address, engine, model):
        base = await make_gateway(engine_addrs=(address,))
        tokenizer = engine.runner.tokenizer
        text = "the cache keeps<|im_end|>"
        async with aiohttp.ClientSession() as http:
            async with http.get(base + "/tokenizer_info") as r:
                assert r.status == 200
                info = await r.json()
            assert (info["model"], info["model_max_length"]) == (model, engine.context_window)
            assert info["eos_token"] == tokenizer.eos_token and info["chat_template"]
            status, tokens = await _post(http, base + "/tokenize",
                                         {"model": model, "prompt": text,
                                          "add_special_tokens": False})
            assert status == 200 and tokens["tokens"] == tokenizer.encode(text)
            assert (tokens["count"], tokens["max_model_len"]) == (
                len(tokens["tokens"]), engine.context_window)
            # lm-eval's remote tokenizer takes the EOS id as the EOS text's first id
            _, eos = await _post(http, base + "/tokenize", {"prompt": info["eos_token"]})
            assert eos["tokens"][0] in info["eos_token_ids"]
            status, back = await _post(http, base + "/detokenize",
                                       {"tokens": tokens["tokens"]})
            assert (status, back) == (200, {"prompt": text})  # special tokens kept
            for url, body, code, param in (
                    ("/tokenize", {"prompt": "x", "add_special_tokens": True}, 400,
                     "add_special_tokens"),
                    ("/tokenize", {"prompt": 5}, 400, "prompt"),
                    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
                    ("/detokenize", {"tokens": [1, -2]}, 400, "tokens[1]"),
                    ("/detokenize", {"tokens": [engine.runner.config.vocab_size]}, 400,
                     "tokens"),  # the engine's to say
                    ("/detokenize", {"tokens": [1], "prompt": "x"}, 400, "prompt"),
                    ("/tokenize", {"prompt": "x", "messages": [{"role": "user",
                                                                 "content": "x"}]}, 400,
                     "prompt"),
                    ("/tokenize", {"messages": [{"role": "user", "content": "x"}],
                                   "add_generation_prompt": False}, 400,
                     "add_generation_prompt"),
                    ("/tokenize", {"prompt": "x", "tools": []}, 400, "tools"),
                    ("/tokenize", {"messages": [{"role": "bot", "content": "x"}]}, 400,
                     "messages[0].role")):
                status, error = await _post(http, base + url, body)
                assert (status, error["error"]["param"]) == (code, param), (body, error)
        # the ids /tokenize gives are a prompt /v1/completions answers as it does the text
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused",
                                      max_retries=0) as client:
            kw = {"model": model, "max_tokens": 4, "temperature": 0}
            by_text = await client.completions.create(prompt="the cache keeps", **kw)
            by_ids = await client.completions.create(
                prompt=tokenizer.encode("the cache keeps"), **kw)
    assert by_ids.choices[0].text == by_text.choices[0].text


async def test_a_chats_ids_are_the_prompt_a_chat_request_counts(make_gateway, tiny_checkpoint):
    async with real_engine(tiny_checkpoint, "engine-tokenize-chat") as (address, engine, model):
        base = await make_gateway(engine_addrs=(address,))
        messages = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "the cache keeps"}]
        tools = [{"type": "function", "function": {"name": "f"}}]
        async with aiohttp.ClientSession() as http, openai.AsyncOpenAI(
                base_url=base + "/v1", api_key="unused", max_retries=0) as client:
            for extra in ({}, {"tools": tools}):
                status, tokens = await _post(http, base + "/tokenize",
                                             {"messages": messages, **extra})
                chat = await client.chat.completions.create(model=model, messages=messages,
                                                            max_tokens=1, **extra)
                assert status == 200 and tokens["count"] == chat.usage.prompt_tokens, extra
            _, back = await _post(http, base + "/detokenize", {"tokens": tokens["tokens"]})
    assert back["prompt"].endswith(engine.runner.tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}], add_generation_prompt=True).rsplit("x", 1)[1])
