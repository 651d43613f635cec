"""Every supported parameter through the official openai client, streaming and not, plus what
reaches the engine: sampling fields, request id, W3C trace context and the deadline."""

import aiohttp
import openai
import pytest

from .conftest import MODEL, real_engine

MESSAGES = [{"role": "user", "content": "say hello"}]
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"


def _sent(servicer):
    return servicer.requests[-1]


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_every_parameter(client, engine, stream):
    servicer, _ = engine
    kwargs = dict(model=MODEL, messages=MESSAGES, temperature=0.7, top_p=0.9, seed=11,
                  stop=["\n\n", "END"], max_completion_tokens=3, n=1, logprobs=True,
                  top_logprobs=2, response_format={"type": "text"}, presence_penalty=0,
                  frequency_penalty=0, user="tester", extra_body={"top_k": 40},
                  extra_headers={"X-Request-Id": f"all-params-{stream}"})
    if stream:
        chunks = [c async for c in await client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs)]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        content = [e for c in chunks if c.choices and c.choices[0].logprobs
                   for e in c.choices[0].logprobs.content]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        assert chunks[-1].usage.completion_tokens == 3
    else:
        reply = await client.chat.completions.create(**kwargs)
        text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
        content = reply.choices[0].logprobs.content
    assert (text, finish) == ("Hello, world", "length")
    assert [e.token for e in content] == ["Hello", ",", " world"]
    assert [e.logprob for e in content] == pytest.approx([-0.1, -0.2, -0.3])
    assert content[0].bytes == list(b"Hello")
    assert [t.token for t in content[2].top_logprobs] == ["alt0", "alt1"]
    assert content[2].top_logprobs[1].logprob == pytest.approx(-2.3)
    sent = _sent(servicer)
    s = sent.sampling
    assert s.temperature == pytest.approx(0.7) and s.top_p == pytest.approx(0.9)
    assert (s.seed, list(s.stop), s.max_tokens, s.top_k) == (11, ["\n\n", "END"], 3, 40)
    assert (s.logprobs, s.top_logprobs) == (True, 2)
    assert sent.request_id == f"all-params-{stream}"


async def test_chat_max_tokens_and_no_logprobs(client, engine):
    servicer, _ = engine
    reply = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert reply.choices[0].message.content == "Hello" and reply.choices[0].logprobs is None
    assert _sent(servicer).sampling.max_tokens == 1 and not _sent(servicer).sampling.logprobs


@pytest.mark.parametrize("stream", [False, True])
async def test_completions_every_parameter(client, engine, stream):
    servicer, _ = engine
    kwargs = dict(model=MODEL, prompt="once upon", max_tokens=2, temperature=0.0, top_p=1.0,
                  seed=5, stop="END", logprobs=3, n=1, best_of=1, echo=False,
                  extra_body={"top_k": 1})
    if stream:
        chunks = [c async for c in await client.completions.create(stream=True, **kwargs)]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        tokens = [t for p in parts for t in p.tokens]
        offsets = [o for p in parts for o in p.text_offset]
        tops = [t for p in parts for t in p.top_logprobs]
    else:
        reply = await client.completions.create(**kwargs)
        text, lp = reply.choices[0].text, reply.choices[0].logprobs
        tokens, offsets, tops = lp.tokens, lp.text_offset, lp.top_logprobs
        assert lp.token_logprobs == pytest.approx([-0.1, -0.2])
    assert text == "Hello,"
    assert tokens == ["Hello", ","] and offsets == [0, 5]
    assert list(tops[0]) == ["alt0", "alt1", "alt2"]
    s = _sent(servicer).sampling
    assert (s.max_tokens, s.seed, list(s.stop), s.top_k, s.logprobs, s.top_logprobs) == (
        2, 5, ["END"], 1, True, 3)


async def test_trace_context_request_id_and_deadline_reach_the_engine(make_gateway, engine):
    servicer, _ = engine
    base = await make_gateway(request_timeout_s=30.0)
    body = {"model": MODEL, "messages": MESSAGES}
    async with aiohttp.ClientSession() as http:
        async with http.post(base + "/v1/chat/completions", json=body,
                             headers={"traceparent": TRACEPARENT, "X-Request-Id": "t-1"}) as r:
            assert r.status == 200
        async with http.post(base + "/v1/chat/completions", json=body,
                             headers={"X-Request-Id": "t-2"}) as r:
            assert r.status == 200
    continued, started = servicer.metadata["t-1"], servicer.metadata["t-2"]
    assert continued["x-request-id"] == "t-1"
    version, trace_id, span_id, flags = continued["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", TRACE_ID, "01")
    assert span_id != "b7ad6b7169203331"  # the gateway is a hop of its own
    new_trace = started["traceparent"].split("-")[1]
    assert len(new_trace) == 32 and new_trace != TRACE_ID and int(new_trace, 16)
    assert 25.0 < servicer.deadlines["t-1"] < 30.5  # the gRPC deadline is the request's


async def test_deadline_exceeded_is_504(make_gateway, engine):
    servicer, _ = engine
    servicer.token_delay_s = 0.2
    base = await make_gateway(request_timeout_s=0.3)
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0) as c:
        with pytest.raises(openai.APIStatusError) as info:
            await c.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert info.value.status_code == 504
    assert info.value.body["code"] == "deadline_exceeded"


@pytest.mark.parametrize(("patch", "param"), [
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"max_tokens": 2**31}, "max_tokens"),
    ({"top_k": 10**9}, "top_k"),
    ({"logit_bias": {"1": 500}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 11}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    # tool calling (tests/gateway/test_tools.py has the rest); the legacy forms by name
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "always"},
     "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),  # without tools
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"max_tokens": 2**31, "max_completion_tokens": 4}, "max_tokens"),  # both validated
    ({"max_tokens": 3, "max_completion_tokens": 4}, "max_tokens"),  # and they disagree
    # a field Strata does not read is refused by name, never ignored
    ({"foo": 1}, "foo"),
    ({"prompt": "hi"}, "prompt"),  # a /v1/completions field
    ({"suffix": ""}, "suffix"),
    ({"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ({"user": 7}, "user"),
    ({"user": "u" * 257}, "user"),
    # and at every depth: a tool's, tool_choice's and response_format's keys
    ({"tools": [{"type": "function", "function": {"name": "f"}, "cache_control": {}}]},
     "tools[0].cache_control"),
    ({"tools": [{"type": "function", "function": {"name": "f", "examples": []}}]},
     "tools[0].function.examples"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "f", "strict": True}}},
     "tool_choice.function.strict"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}, "allowed": ["f"]}},
     "tool_choice.allowed"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "object"}, "description": "an answer"}}},
     "response_format.json_schema.description"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schma": {}}}},
     "response_format.json_schema.schma"),
])
async def test_unsupported_or_out_of_bounds_is_a_clear_400(client, engine, patch, param):
    servicer, _ = engine
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=patch)
    assert info.value.body["param"] == param
    assert servicer.requests == []


@pytest.mark.parametrize(("patch", "param"), [
    ({"messages": MESSAGES}, "messages"),  # a chat field
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"top_logprobs": 2}, "top_logprobs"),  # the chat form; completions take logprobs: N
    ({"metadata": {"k": "v"}}, "metadata"),
])
async def test_completions_refuse_a_field_they_do_not_read_by_name(client, engine, patch, param):
    servicer, _ = engine
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(model=MODEL, prompt="hi", extra_body=patch)
    assert info.value.body["param"] == param
    assert info.value.body["code"] == "unsupported_parameter"
    assert servicer.requests == []


@pytest.mark.parametrize(("body", "param"), [
    ('{"model": "%s", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
     "messages[0].content"),
    ('{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "stop": ["\\udfff"]}',
     "stop[0]"),
])
async def test_a_lone_surrogate_is_a_400_naming_its_field(make_gateway, engine, body, param):
    """JSON lets a lone UTF-16 surrogate through (the openai client cannot even send one);
    it is refused by name before anything reaches the engine, not a 500."""
    servicer, _ = engine
    base = await make_gateway()
    async with aiohttp.ClientSession() as http, http.post(
            base + "/v1/chat/completions", data=body % MODEL,
            headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400
        error = (await r.json())["error"]
    assert error["param"] == param and "lone surrogate" in error["message"]
    assert servicer.requests == []


@pytest.mark.parametrize("stream", [False, True])
async def test_completions_n_choices_each_with_its_own_logprobs(client, engine, stream):
    """n = 2 on /v1/completions: two engine requests (seeds 5 and 6), two choices by index,
    each choice's logprob text offsets counted from its own text."""
    servicer, _ = engine
    kwargs = dict(model=MODEL, prompt="once upon", max_tokens=2, seed=5, logprobs=1, n=2)
    if stream:
        chunks = [c async for c in await client.completions.create(stream=True, **kwargs)]
        text = {i: "".join(c.choices[0].text for c in chunks if c.choices
                           and c.choices[0].index == i) for i in (0, 1)}
        offsets = {i: [o for c in chunks if c.choices and c.choices[0].index == i
                       and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
                   for i in (0, 1)}
    else:
        reply = await client.completions.create(**kwargs)
        assert [ch.index for ch in reply.choices] == [0, 1]
        assert reply.usage.completion_tokens == 4
        text = {ch.index: ch.text for ch in reply.choices}
        offsets = {ch.index: ch.logprobs.text_offset for ch in reply.choices}
    assert text == {0: "Hello,", 1: "Hello,"} and offsets == {0: [0, 5], 1: [0, 5]}
    assert sorted(r.sampling.seed for r in servicer.requests[-2:]) == [5, 6]


@pytest.mark.parametrize(("message", "param", "code"), [
    ({"role": "user", "content": "hi", "audio": {"id": "a1"}}, "messages[1].audio",
     "unsupported_parameter"),
    ({"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
     "messages[1].function_call", "unsupported_parameter"),
    ({"role": "user", "content": "hi", "not_a_field": 1}, "messages[1].not_a_field",
     "unsupported_parameter"),
    ({"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]},
     "messages[1].content[0].cache_control", "unsupported_parameter"),
    ({"role": "user", "content": "hi", "tool_call_id": "call_1"}, "messages[1].tool_call_id",
     "invalid_value"),
    ({"role": "user", "content": "hi", "refusal": "no"}, "messages[1].refusal",
     "invalid_value"),
    ({"role": "system", "content": "hi", "reasoning_content": "hm"},
     "messages[1].reasoning_content", "invalid_value"),
    ({"role": "assistant", "content": "sure", "refusal": "no"}, "messages[1].refusal",
     "invalid_value"),
    ({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"},
         "extra_content": {}}]}, "messages[1].tool_calls[0].extra_content",
     "unsupported_parameter"),
    ({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}",
                                                      "parsed": {}}}]},
     "messages[1].tool_calls[0].function.parsed", "unsupported_parameter"),
    ({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "index": 1, "function": {"name": "f", "arguments": "{}"}}]},
     "messages[1].tool_calls[0].index", "invalid_value"),
    ({"role": "user", "content": "hi", "name": ""}, "messages[1].name", "invalid_value"),
    ({"role": "user", "content": "hi", "name": 7}, "messages[1].name", "invalid_value"),
])
async def test_a_message_field_not_read_or_out_of_place_is_a_400_naming_it(client, engine,
                                                                          message, param, code):
    servicer, _ = engine
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=MODEL, messages=[*MESSAGES, message])
    assert (info.value.body["param"], info.value.body["code"]) == (param, code)
    assert servicer.requests == []


async def test_a_reply_echoed_into_the_history_is_taken_whole(client, engine):
    """The assistant message as the openai client returns it (refusal, audio, function_call
    null; Strata's reasoning_content) goes back in as history; a participant name and a
    refusal given as text reach the engine too."""
    servicer, _ = engine
    reply = await client.chat.completions.create(model=MODEL, messages=MESSAGES)
    echoed = {**reply.choices[0].message.model_dump(), "reasoning_content": "think first"}
    assert {"refusal", "audio", "function_call"} <= set(echoed)
    await client.chat.completions.create(model=MODEL, messages=[
        {"role": "user", "content": "say hello", "name": "ada"}, echoed,
        {"role": "user", "content": "no"}, {"role": "assistant", "refusal": "I won't."},
        {"role": "user", "content": "ok"}])
    sent = _sent(servicer).chat.messages
    assert (sent[0].name, sent[1].content, sent[1].reasoning_content) == (
        "ada", reply.choices[0].message.content, "think first")
    assert (sent[3].role, sent[3].content) == ("assistant", "I won't.")


async def test_a_name_the_models_template_drops_is_a_400_from_the_real_engine(
        make_gateway, tiny_checkpoint):
    """Whether a message's name reaches the model is the chat template's to say: the tiny
    model's (ChatML) drops names, so the engine refuses one and the 400 names the field."""
    async with real_engine(tiny_checkpoint, "engine-names") as (address, engine, model):
        base = await make_gateway(engine_addrs=(address,))
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused",
                                      max_retries=0) as client:
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model=model, max_tokens=2, messages=[
                    {"role": "system", "content": "be brief", "name": "house"},
                    {"role": "user", "content": "hi"}])
            reply = await client.chat.completions.create(model=model, max_tokens=2, messages=[
                {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert (info.value.body["param"], info.value.body["code"]) == ("messages[0].name",
                                                                   "unsupported_parameter")
    assert "does not show a system message's name" in info.value.body["message"]
    assert reply.choices[0].finish_reason == "length"
    assert engine.totals.requests_finished == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_completions_batched_and_token_id_prompts_from_the_real_engine(
        make_gateway, tiny_checkpoint, stream):
    """OpenAI's four prompt forms (what lm-evaluation-harness sends: batches of token ids):
    each prompt gets n choices, in OpenAI's order (prompt by prompt); a choice answers as its
    prompt sent alone would, greedy and seeded; token ids are taken as they are (the text's
    own ids give the text's answer); usage counts each prompt once. A bad id is a 400."""
    async with real_engine(tiny_checkpoint, "engine-prompts") as (address, engine, model):
        base = await make_gateway(engine_addrs=(address,))
        ids = list(engine.runner.tokenizer.encode("the cache keeps"))
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused",
                                      max_retries=0) as client:
            async def texts(prompt, **kw):
                kw = {"model": model, "prompt": prompt, "max_tokens": 6, **kw}
                if not stream:
                    reply = await client.completions.create(**kw)
                    assert [ch.index for ch in reply.choices] == list(range(len(reply.choices)))
                    return [ch.text for ch in reply.choices], reply.usage
                parts, usage = {}, None
                async for chunk in await client.completions.create(
                        stream=True, stream_options={"include_usage": True}, **kw):
                    for ch in chunk.choices:
                        parts[ch.index] = parts.get(ch.index, "") + ch.text
                    usage = chunk.usage or usage
                return [parts[i] for i in sorted(parts)], usage

            (once,), u1 = await texts("once upon a time", temperature=0)
            (cache,), u2 = await texts("the cache keeps", temperature=0)
            assert (await texts(ids, temperature=0))[0] == [cache]
            batch, usage = await texts(["once upon a time", ids], temperature=0, n=2)
            assert batch == [once, once, cache, cache]
            assert usage.prompt_tokens == u1.prompt_tokens + u2.prompt_tokens
            assert usage.completion_tokens == 2 * (u1.completion_tokens + u2.completion_tokens)
            sampled = dict(temperature=1.0, seed=7, max_tokens=12)
            alone = (await texts([ids], n=2, **sampled))[0]
            assert (await texts([[5, 9], ids], n=2, **sampled))[0][2:] == alone
            vocab = engine.runner.config.vocab_size
            for bad, param in (({"prompt": [vocab]}, "prompt"),  # the engine's to say
                               ({"prompt": [[1, 2], []]}, "prompt[1]"),
                               ({"prompt": [ids] * 17}, "prompt"),
                               ({"prompt": ids, "logit_bias": {str(vocab): 1}}, "logit_bias")):
                with pytest.raises(openai.BadRequestError) as info:
                    await client.completions.create(model=model, max_tokens=2, **bad)
                assert (info.value.body["param"], info.value.body["code"]) == (
                    param, "invalid_value"), info.value.body


@pytest.mark.parametrize("stream", [False, True])
async def test_completions_echo_with_prompt_logprobs_from_the_real_engine(
        make_gateway, tiny_checkpoint, stream):
    """echo (lm-evaluation-harness's loglikelihood: echo, logprobs 1, max_tokens 1): the prompt
    comes back before the completion, and its tokens' logprobs are the model's own, checked
    against a second runner scoring the same ids at every position (the first token's null).
    A prompt longer than a step's token budget is scored across prefill chunks; a prefix the
    cache holds is computed again, not skipped."""
    import torch

    from services.engine.driver import SequenceDriver
    from services.engine.runner import ModelRunner

    reference = SequenceDriver(ModelRunner(tiny_checkpoint, cache_slots=8, reserved_bytes=0))
    async with real_engine(tiny_checkpoint, "engine-echo", max_step_tokens=64) as (
            address, engine, model):
        base = await make_gateway(engine_addrs=(address,))
        tokenizer = engine.runner.tokenizer
        prompt = "the cache keeps experts in device memory " * 4  # > one step's tokens
        ids = list(tokenizer.encode(prompt))
        assert len(ids) > engine.scheduler.max_step_tokens
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused",
                                      max_retries=0) as client:
            kw = dict(model=model, max_tokens=3, temperature=0)
            plain = (await client.completions.create(prompt=prompt, **kw)).choices[0].text
            for _ in range(2):  # the second time the prefix cache holds the prompt
                if stream:
                    chunks = [c async for c in await client.completions.create(
                        prompt=prompt, echo=True, logprobs=2, stream=True, **kw)]
                    text = "".join(c.choices[0].text for c in chunks if c.choices)
                    lps = [c.choices[0].logprobs for c in chunks
                           if c.choices and c.choices[0].logprobs]
                    tokens = [t for lp in lps for t in lp.tokens]
                    values = [v for lp in lps for v in lp.token_logprobs]
                    tops = [t for lp in lps for t in lp.top_logprobs]
                else:
                    choice = (await client.completions.create(
                        prompt=prompt, echo=True, logprobs=2, **kw)).choices[0]
                    text, tokens = choice.text, choice.logprobs.tokens
                    values, tops = choice.logprobs.token_logprobs, choice.logprobs.top_logprobs
                assert text == prompt + plain
                assert len(tokens) == len(ids) + 3 and values[0] is None and tops[0] is None
                expected = torch.log_softmax(reference.score(ids), dim=-1)
                want = [expected[p, ids[p + 1]].item() for p in range(len(ids) - 1)]
                assert values[1:len(ids)] == pytest.approx(want, abs=1e-4)
                assert all(len(t) == 2 and max(t.values()) >= v - 1e-6
                           for t, v in zip(tops[1:], values[1:], strict=True))
            echoed = await client.completions.create(model=model, prompt=[ids[:5]], echo=True,
                                                     max_tokens=1)
            assert echoed.choices[0].text.startswith(tokenizer.decode(ids[:5]))
            # max_tokens 0 (the legacy scoring form): the prompt and its logprobs alone
            alone = await client.completions.create(model=model, prompt=prompt, echo=True,
                                                    logprobs=2, max_tokens=0, stream=stream)
            if stream:
                chunks = [c async for c in alone]
                choices = [c.choices[0] for c in chunks if c.choices]
                text = "".join(ch.text for ch in choices)
                got = [v for ch in choices if ch.logprobs for v in ch.logprobs.token_logprobs]
                finish = choices[-1].finish_reason
            else:
                choice = alone.choices[0]
                text, got, finish = choice.text, choice.logprobs.token_logprobs, \
                    choice.finish_reason
                assert alone.usage.completion_tokens == 0
            assert (text, finish, len(got)) == (prompt, "length", len(ids))
            assert got[1:] == pytest.approx(want, abs=1e-4)
            for bad, param in (({"max_tokens": 0}, "max_tokens"),
                               ({"max_tokens": 0, "echo": True, "extra_body": {"min_tokens": 1}},
                                "min_tokens")):
                with pytest.raises(openai.BadRequestError) as info:
                    await client.completions.create(model=model, prompt=prompt, **bad)
                assert info.value.body["param"] == param
