"""End to end: `strata up` on the default model, called with the official openai client."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request

import aiohttp
import openai
import pytest

from services.models import DEFAULT_MODEL_NAME as MODEL
from services.models import default_model_dir

pytestmark = pytest.mark.e2e
WINDOW = json.loads((default_model_dir() / "config.json").read_text())["max_position_embeddings"]

PROMPT = [{"role": "user", "content": "Name three prime numbers."}]
LINE_1 = re.compile(r"strata serve: prompt (\d+) tokens = (\d+) reused \+ (\d+) read in \d+ ms, "
                    r"(\d+) generated in \d+ ms \([\d.]+ tok/s\)")
LINE_2 = re.compile(r"strata serve: decode expert cache hit rate: [\d.]+% \((\d+) hits / (\d+) "
                    r"lookups\); (\d+) more spilled, served by no cache slot")


def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0)


def test_chat_completion_reports_usage_and_logs_two_lines(cluster):
    before = cluster.engine_log().count("strata serve: prompt")
    reply = client(cluster).chat.completions.create(
        model=MODEL, messages=PROMPT, max_tokens=12, temperature=0)
    assert reply.choices[0].finish_reason in {"stop", "length"}
    assert reply.usage.completion_tokens >= 1 and reply.usage.prompt_tokens > 5
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens

    deadline = time.monotonic() + 10
    while cluster.engine_log().count("strata serve: prompt") == before:
        assert time.monotonic() < deadline, "the engine did not log the request"
        time.sleep(0.1)
    lines = [line for line in cluster.engine_log().splitlines() if "strata serve:" in line]
    first, second = LINE_1.search(lines[-2]), LINE_2.search(lines[-1])
    assert first and second, lines[-2:]
    assert int(first.group(1)) == reply.usage.prompt_tokens
    assert int(first.group(4)) == reply.usage.completion_tokens
    hits, lookups, spilled = map(int, second.groups())
    assert hits + spilled == lookups > 0


def test_streaming_matches_non_streaming(cluster):
    c = client(cluster)
    # ignore_eos: all 16 tokens are compared, however early the model would stop
    whole = c.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=16,
                                      temperature=0, extra_body={"ignore_eos": True})
    chunks = list(c.chat.completions.create(
        model=MODEL, messages=PROMPT, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 16


def test_code_prompt_gets_python_looking_text(cluster):
    """The default model is trained on the standard library: a code prompt gets code back, text
    that re-tokenizes mostly into learned multi-character merges, not byte-level debris."""
    from services.engine.model.tokenizer import Tokenizer

    reply = client(cluster).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "def read_config(path):"}],
        max_tokens=64, temperature=0)
    text = reply.choices[0].message.content
    assert reply.usage.completion_tokens >= 16 and text.strip()
    assert text.encode("utf-8").decode("utf-8") == text and "\ufffd" not in text
    tokenizer = Tokenizer(default_model_dir())
    ids = tokenizer.encode(text)
    merged = sum(len(tokenizer.decode([i])) >= 2 for i in ids) / len(ids)
    assert merged >= 0.6, (merged, text)
    python = ("self", "return", "def ", "if ", "None", "(", ")", ":", "=", "    ")
    assert sum(marker in text for marker in python) >= 4, text


def test_models_lists_the_default_model(cluster):
    ids = [m.id for m in client(cluster).models.list()]
    assert ids == [MODEL]


def test_cache_metrics_reach_the_cachemgr_endpoint(cluster):
    client(cluster).chat.completions.create(model=MODEL, messages=PROMPT,
                                            max_tokens=4, temperature=0)
    url = f"http://127.0.0.1:{cluster.metrics_port}/metrics"
    deadline = time.monotonic() + 20
    while True:
        body = urllib.request.urlopen(url, timeout=5).read().decode()
        lookups = [line for line in body.splitlines()
                   if line.startswith("strata_cache_lookups") and not line.endswith(" 0.0")]
        if "strata_cache_slots" in body and "strata_cache_coverage" in body and lookups:
            break
        assert time.monotonic() < deadline, body[-3000:]
        time.sleep(0.5)


async def test_overload_gives_exactly_queue_plus_inflight_answers(cluster):
    """--max-inflight 1 --max-queue 2: of 10 simultaneous streams that cannot end by themselves
    (ignore_eos, as long as the window allows), 7 get 429 while the other 3 are all still open,
    one streaming and two queued; each closed stream lets the next one in. Exact whatever the
    machine's speed: no admitted request can finish and free its place during the burst."""
    body = {"model": MODEL, "messages": PROMPT, "max_tokens": 2000, "ignore_eos": True,
            "temperature": 0, "stream": True}
    url = f"{cluster.base_url}/chat/completions"

    async def wait_answered(tasks, count, timeout_s=60.0):
        deadline = time.monotonic() + timeout_s
        while sum(t.done() for t in tasks) < count:
            assert time.monotonic() < deadline, [t.done() for t in tasks]
            await asyncio.sleep(0.05)
        return [t.result() for t in tasks if t.done()]

    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(session.post(url, json=body)) for _ in range(10)]
        try:
            answered = await wait_answered(tasks, 8)
            assert sorted(r.status for r in answered) == [200] + [429] * 7
            rejected = [r for r in answered if r.status == 429]
            for r in rejected:
                error = (await r.json())["error"]
                assert int(r.headers["Retry-After"]) >= 1 and error["code"] == "queue_full"
            served = []
            for num_open in (8, 9, 10):  # the streaming one, then each queued one in turn
                answered = await wait_answered(tasks, num_open)
                [stream] = [r for r in answered if r.status == 200 and r not in served]
                await stream.content.readuntil(b"\n\n")  # the role chunk
                token = await stream.content.readuntil(b"\n\n")
                assert b'"content"' in token and b"[DONE]" not in token
                assert sum(not t.done() for t in tasks) == 10 - num_open  # the rest still queued
                served.append(stream)
                stream.close()  # leaves: its slot goes to the next in the queue
        finally:
            for t in tasks:
                t.cancel()
            for r in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(r, aiohttp.ClientResponse):
                    r.close()
    assert len(served) == 3


@pytest.mark.parametrize(("payload", "status"), [
    (b"{not json", 400),
    (b'{"model": "strata-stdlib-moe"}', 400),
    (b'{"model": "strata-stdlib-moe", "messages": "hi"}', 400),
    (b'{"model": "strata-stdlib-moe", "messages": [{"role": "user", "content": 5}]}', 400),
    (b'{"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}', 404),
    (b'{"model": "strata-stdlib-moe", "messages": [{"role": "user", "content": "hi"}], '
     b'"max_tokens": -3}', 400),
])
async def test_bad_input_gets_an_openai_error_and_the_gateway_keeps_serving(
        cluster, payload, status):
    async with (aiohttp.ClientSession() as session,
                session.post(f"{cluster.base_url}/chat/completions", data=payload,
                             headers={"Content-Type": "application/json"}) as r):
        assert r.status == status
        error = (await r.json())["error"]
        assert {"message", "type", "param", "code"} <= error.keys() and error["message"]
    reply = client(cluster).chat.completions.create(model=MODEL, messages=PROMPT,
                                                    max_tokens=2, temperature=0)
    assert reply.usage.completion_tokens >= 1


def test_over_long_prompt_is_a_400_with_both_token_counts(cluster):
    with pytest.raises(openai.BadRequestError) as caught:
        client(cluster).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x " * 5000}],
            max_tokens=4)
    message = caught.value.body["message"]
    assert f"{WINDOW}" in message and re.search(r"\b\d{3,5} tokens", message), message


def test_engine_holds_the_cache_managers_plan_and_is_registered(cluster):
    import grpc

    from services.common.pb.strata.v1 import engine_pb2, engine_pb2_grpc
    from services.common.registry import EngineRegistry

    with grpc.insecure_channel(f"127.0.0.1:{cluster.engine_port}") as channel:
        status = engine_pb2_grpc.EngineStub(channel).GetStatus(engine_pb2.GetStatusRequest(),
                                                               timeout=5)
    assert status.cache.plan_version >= 1 and status.cache.plan_source
    redis_url = re.search(r"redis: embedded server at (\S+)", cluster.output.read_text()).group(1)
    engines = asyncio.run(EngineRegistry(redis_url).engines())
    assert [e.address for e in engines] == [f"127.0.0.1:{cluster.engine_port}"]


def test_strata_top_shows_the_engine(cluster):
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "services.cli", "top", "--once", "--json",
                          "--cachemgr", f"127.0.0.1:{cluster.cachemgr_port}"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    engines = json.loads(out.stdout)["cachemgr"]["engines"]
    assert len(engines) == 1 and int(engines[0]["slots"]) > 0, engines


def test_a_repeated_prompt_reuses_cached_kv_blocks_and_answers_the_same(cluster):
    messages = [{"role": "system", "content": "You are a careful assistant. " * 8},
                {"role": "user", "content": "What is an expert cache?"}]
    c = client(cluster)
    first = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                      temperature=0)
    again = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                      temperature=0)
    assert again.choices[0].message.content == first.choices[0].message.content
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == again.usage.prompt_tokens - 1, "all but the last token (token-granular)"


async def test_disconnect_storm_leaves_the_engine_idle_with_every_kv_block_free(cluster):
    """Clients that leave mid-stream cancel their engine work: running and waiting return to 0
    and every KV block is free again (design: nothing lost, a rejected/cancelled request costs
    the engine nothing more)."""
    import grpc

    from services.common.pb.strata.v1 import engine_pb2, engine_pb2_grpc

    body = {"model": MODEL, "messages": PROMPT, "max_tokens": 2000,
            "temperature": 0.8, "stream": True}

    async def leave_mid_stream(session):
        async with session.post(f"{cluster.base_url}/chat/completions", json=body) as r:
            if r.status != 200:
                return r.status
            await r.content.readuntil(b"\n\n")  # the role chunk
            await r.content.readuntil(b"\n\n")  # a token
            r.close()
            return 200

    def engine_status():
        with grpc.insecure_channel(f"127.0.0.1:{cluster.engine_port}") as channel:
            return engine_pb2_grpc.EngineStub(channel).GetStatus(engine_pb2.GetStatusRequest(),
                                                                 timeout=5)

    async def idle_status(timeout_s: float = 15.0):
        """The engine's status once nothing runs or waits (earlier tests' cancelled requests
        may still be finishing on a loaded machine) and every KV block is free."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = await asyncio.to_thread(engine_status)
            if (status.running, status.waiting) == (0, 0) and \
                    status.kv_blocks_free == status.kv_blocks_total:
                return status
            assert time.monotonic() < deadline, status
            await asyncio.sleep(0.1)

    before = await idle_status()
    async with aiohttp.ClientSession() as session:
        statuses = await asyncio.gather(*(leave_mid_stream(session) for _ in range(12)))
    served = statuses.count(200)
    # In-flight 1 + queue 2 at once; a slow machine may admit more as the first ones leave.
    assert served >= 3 and served + statuses.count(429) == 12, statuses

    status = await idle_status()
    # A client may leave before the gateway's call reached the engine (it then never runs
    # there); every call that did reach it has finished.
    assert 1 <= status.requests_finished - before.requests_finished <= served
    assert status.tokens_generated - before.tokens_generated < served * 2000 // 10, \
        "the engine kept generating for clients that had left"


def test_sampling_fields_reach_the_engine_and_do_what_they_say(cluster):
    """The vLLM-style and OpenAI sampling fields through the official client (their exact
    arithmetic: tests/engine/test_sampling.py): ignore_eos runs to max_tokens; logit_bias
    forces a token; stop_token_ids ends at it, after min_tokens at the earliest; the penalties
    change the greedy continuation."""
    from services.engine.model.tokenizer import Tokenizer

    tok = Tokenizer(default_model_dir())
    (x_id,) = tok.encode("x")
    c = client(cluster)

    def complete(**extra):
        return c.completions.create(model=MODEL, prompt="def f(x):\n    return", max_tokens=24,
                                    temperature=0, extra_body=extra)

    long = complete(ignore_eos=True)
    assert long.usage.completion_tokens == 24 and long.choices[0].finish_reason == "length"
    forced = complete(logit_bias={str(x_id): 100})
    assert forced.choices[0].text == "x" * 24
    stopped = complete(logit_bias={str(x_id): 100}, stop_token_ids=[x_id])
    assert stopped.usage.completion_tokens == 0 and stopped.choices[0].finish_reason == "stop"
    later = complete(logit_bias={str(x_id): 100}, stop_token_ids=[x_id], min_tokens=5)
    assert later.usage.completion_tokens == 5 and later.choices[0].finish_reason == "stop"
    assert "x" not in later.choices[0].text
    plain = complete(ignore_eos=True).choices[0].text
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
                    {"repetition_penalty": 1.8}):
        assert complete(ignore_eos=True, **penalty).choices[0].text != plain, penalty


def test_n_choices_are_independent_requests_of_one_prompt(cluster):
    """n = 3: three choices; greedy ones equal, seeded sampled ones different; the prompt is
    counted once and every choice's tokens; streamed choices (by index) assemble to the same
    texts."""
    c = client(cluster)
    greedy = c.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=12,
                                       temperature=0, n=3)
    texts = [ch.message.content for ch in greedy.choices]
    assert [ch.index for ch in greedy.choices] == [0, 1, 2] and len(set(texts)) == 1
    one = c.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=12, temperature=0)
    assert greedy.usage.prompt_tokens == one.usage.prompt_tokens
    assert greedy.usage.completion_tokens == 3 * one.usage.completion_tokens
    sampled = c.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=24,
                                        temperature=1.0, seed=11, n=3)
    assert len({ch.message.content for ch in sampled.choices}) > 1
    again = c.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=24,
                                      temperature=1.0, seed=11, n=3)
    assert [ch.message.content for ch in again.choices] == [
        ch.message.content for ch in sampled.choices]  # seed + i per choice: reproducible
    parts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in c.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=12,
                                           temperature=0, n=2, stream=True,
                                           stream_options={"include_usage": True}):
        for ch in chunk.choices:
            parts[ch.index] = parts.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens == 2 * one.usage.completion_tokens
    assert parts == {0: texts[0], 1: texts[0]} and set(finish) == {0, 1}


def test_a_response_is_stored_in_redis_continued_and_deleted(cluster):
    """The Responses API on the real cluster: its records in the cluster's Redis."""
    import redis

    c = client(cluster)
    kw = {"model": MODEL, "max_output_tokens": 8, "temperature": 0}
    first = c.responses.create(input="Name three prime numbers.", **kw)
    chat = c.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=8, temperature=0)
    assert first.output_text == chat.choices[0].message.content
    assert redis.Redis.from_url(cluster.redis_url).exists(f"strata:response:{first.id}")
    events = list(c.responses.create(previous_response_id=first.id, input="And two more?",
                                     stream=True, **kw))
    second = events[-1].response
    assert events[0].type == "response.created" and second.previous_response_id == first.id
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        second.output_text
    counted = c.responses.input_tokens.count(model=MODEL, input="And two more?",
                                             previous_response_id=first.id)
    assert counted.input_tokens == second.usage.input_tokens
    assert c.responses.retrieve(second.id).output_text == second.output_text
    queued = c.responses.create(input="Name three prime numbers.", background=True, **kw)
    assert queued.status in ("queued", "in_progress") and queued.background
    for _ in range(200):
        if (polled := c.responses.retrieve(queued.id)).status not in ("queued", "in_progress"):
            break
        time.sleep(0.05)
    assert (polled.status, polled.output_text) == (first.status, first.output_text)
    conv = c.conversations.create()
    turn = c.responses.create(input="Name three prime numbers.", conversation=conv.id, **kw)
    assert turn.output_text == first.output_text
    assert len(list(c.conversations.items.list(conv.id))) == 2
    assert redis.Redis.from_url(cluster.redis_url).exists(f"strata:conversation-items:{conv.id}")
    c.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(first.id)
