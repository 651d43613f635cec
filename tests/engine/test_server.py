"""The engine's gRPC surface on a real server (loopback port) over a tiny checkpoint."""

from __future__ import annotations

import asyncio
import math
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.pb.strata.v1 import engine_pb2, engine_pb2_grpc
from services.engine.core import Engine
from services.engine.runner import ModelRunner
from services.engine.server import StatusSource, set_serving, start_server


@pytest.fixture
async def engine_stub(tiny_dir):
    # Room for half of the 24 pairs.
    runner = ModelRunner(tiny_dir, cache_slots=12, reserved_bytes=0)
    runner.fill_cache(runner.layer_order_pairs(), source="layer order")
    engine = Engine(runner)
    status = StatusSource(engine, "test-engine", runner.model_name, "cpu")
    server, port, health = await start_server(engine, status, "127.0.0.1", 0)
    engine.start()
    await set_serving(health, True)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield engine_pb2_grpc.EngineStub(channel), channel, engine
    await channel.close()
    await server.stop(grace=None)
    engine.stop()


def request(prompt: str = "The cache", **sampling) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(request_id="r1", prompt=prompt,
                                      sampling=engine_pb2.SamplingParams(**sampling))


async def collect(stub, req) -> list[engine_pb2.GenerateEvent]:
    return [event async for event in stub.Generate(req)]


async def test_generate_streams_started_deltas_and_one_finished(engine_stub):
    stub, _, _ = engine_stub
    events = await collect(stub, request(max_tokens=8))
    started = [e.HasField("started") for e in events]
    finished = [e.HasField("finished") for e in events]
    assert started[0] and sum(started) == 1 and finished[-1] and sum(finished) == 1
    assert all(e.HasField("delta") for e in events[1:-1])
    assert events[0].started.engine_id == "test-engine"
    # Once the engine is stepping, a request's Started goes out with its first tokens, in
    # one message, not alone in the middle of the step that computes them.
    again = await collect(stub, request(max_tokens=8))
    assert again[0].HasField("started") and again[0].HasField("delta")
    finished = events[-1].finished
    tokens = [t for e in events if e.HasField("delta") for t in e.delta.token_ids]
    assert finished.stats.completion_tokens == len(tokens) <= 8
    d = finished.stats.decode
    assert d.hits + d.misses_host + d.misses_copied == d.lookups


async def test_greedy_is_deterministic_and_logprobs_are_consistent(engine_stub):
    stub, _, _ = engine_stub
    first = await collect(stub, request(max_tokens=6, logprobs=True, top_logprobs=3))
    second = await collect(stub, request(max_tokens=6))
    ids = [t for e in first if e.HasField("delta") for t in e.delta.token_ids]
    assert ids == [t for e in second if e.HasField("delta") for t in e.delta.token_ids]
    logprobs = [lp for e in first if e.HasField("delta") for lp in e.delta.logprobs]
    assert [lp.token_id for lp in logprobs] == ids
    for lp in logprobs:
        assert len(lp.top) == 3 and lp.top[0].token_id == lp.token_id  # greedy = most likely
        assert math.isclose(lp.top[0].logprob, lp.logprob, abs_tol=1e-6) and lp.logprob <= 0
        assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)


async def test_stop_string_and_max_tokens_end_the_request(engine_stub):
    stub, _, _ = engine_stub
    events = await collect(stub, request(max_tokens=5, ignore_eos=True))
    assert events[-1].finished.reason == engine_pb2.FINISH_REASON_LENGTH
    text = "".join(e.delta.text for e in events if e.HasField("delta"))
    assert len(text) >= 4, text  # five greedy byte tokens of this checkpoint: room for a stop
    stop = text[2:4]  # two characters: the first is held back until the second decides
    stopped = await collect(stub, request(max_tokens=5, ignore_eos=True, stop=[stop]))
    out = "".join(e.delta.text for e in stopped if e.HasField("delta"))
    assert stopped[-1].finished.reason == engine_pb2.FINISH_REASON_STOP
    assert out == text[: text.index(stop)] and len(out) >= 2


async def test_over_long_prompt_is_invalid_argument_with_both_counts(engine_stub):
    stub, _, engine = engine_stub
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(stub, request("word " * 400))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"context window is {engine.context_window} tokens" in caught.value.details()
    assert engine.totals.requests_finished == 0


async def test_a_name_the_template_drops_is_invalid_argument_naming_the_field(engine_stub):
    """The demo template (ChatML) shows no participant names: a named message is refused, and
    the call's trailing metadata names the field for the gateway's 400."""
    from services.common.rpc_errors import CODE_KEY, PARAM_KEY

    stub, _, engine = engine_stub
    req = engine_pb2.GenerateRequest(
        request_id="named", sampling=engine_pb2.SamplingParams(max_tokens=2),
        chat=engine_pb2.ChatInput(messages=[
            engine_pb2.ChatMessage(role="user", content="hi"),
            engine_pb2.ChatMessage(role="user", content="again", name="ada")]))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(stub, req)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not show a user message's name" in caught.value.details()
    trailer = dict(caught.value.trailing_metadata())
    assert (trailer[PARAM_KEY], trailer[CODE_KEY]) == ("messages[1].name",
                                                       "unsupported_parameter")
    assert engine.totals.requests_finished == 0


async def test_cancelled_call_stops_generation_and_the_engine_moves_on(engine_stub):
    stub, _, engine = engine_stub
    call = stub.Generate(request(max_tokens=400, temperature=0.8, seed=3))
    async for event in call:
        if event.HasField("delta"):
            break
    call.cancel()
    for _ in range(100):
        if engine.totals.requests_finished == 1:
            break
        await asyncio.sleep(0.05)
    assert engine.totals.requests_finished == 1
    assert engine.totals.tokens_generated < 400
    events = await collect(stub, request(max_tokens=3))
    assert events[-1].HasField("finished")


async def test_status_and_health(engine_stub):
    stub, channel, _ = engine_stub
    await collect(stub, request(max_tokens=4))
    status = await stub.GetStatus(engine_pb2.GetStatusRequest())
    assert status.ready and status.engine_id == "test-engine" and status.requests_finished == 1
    assert status.cache.total_pairs == 3 * 8 and 0 < status.cache.coverage < 1
    d = status.cache.decode
    assert d.hits + d.misses_host + d.misses_copied == d.lookups > 0
    health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING


async def test_deltas_carry_every_token_once_and_ignore_eos_reaches_max_tokens(engine_stub):
    stub, _, _ = engine_stub
    events = await collect(stub, request(max_tokens=12, ignore_eos=True))
    deltas = [e.delta for e in events if e.HasField("delta")]
    # One message a step, or several steps' in one when this reader fell behind: together
    # exactly the finished request's tokens.
    assert sum(len(d.token_ids) for d in deltas) == events[-1].finished.stats.completion_tokens
    assert events[-1].finished.stats.completion_tokens == 12
    assert events[-1].HasField("delta")  # the last tokens come with Finished


async def test_stream_interval_holds_tokens_into_fewer_messages(engine_stub):
    stub, _, _ = engine_stub
    plain = await collect(stub, request(max_tokens=24, ignore_eos=True))
    held = engine_pb2.GenerateRequest(request_id="r2", prompt="The cache", stream_interval_ms=500,
                                      sampling=engine_pb2.SamplingParams(max_tokens=24,
                                                                         ignore_eos=True))
    started = time.perf_counter()
    events = await collect(stub, held)
    took_s = time.perf_counter() - started

    def ids(evs):
        return [t for e in evs if e.HasField("delta") for t in e.delta.token_ids]

    assert ids(events) == ids(plain) and len(ids(events)) == 24  # the same tokens, in order
    # The first tokens go out at once, then at most one message per 0.5 s (and Finished with
    # the last ones, unheld): a step's message each would be 24.
    deltas = [e for e in events if e.HasField("delta")]
    assert len(deltas) <= 2 + took_s / 0.5 < 24
    assert events[-1].HasField("finished")


async def test_a_hold_as_long_as_the_request_ends_with_the_request(engine_stub):
    """What the gateway asks for a non-streaming request: the first tokens at once, then
    everything else with Finished, in one message (the hold ends when the request does)."""
    stub, _, _ = engine_stub
    whole = engine_pb2.GenerateRequest(request_id="r3", prompt="The cache",
                                       stream_interval_ms=600_000,
                                       sampling=engine_pb2.SamplingParams(max_tokens=24,
                                                                          ignore_eos=True))
    events = await asyncio.wait_for(collect(stub, whole), 60)
    deltas = [e.delta for e in events if e.HasField("delta")]
    assert len(deltas) <= 2 and sum(len(d.token_ids) for d in deltas) == 24
    assert events[-1].HasField("finished")


def test_names_and_reasoning_reach_a_template_that_shows_them(tmp_path):
    """A proto message's name and reasoning_content reach the chat template; a name on a role
    whose names it drops (here the assistant's) is refused by name before anything runs."""
    from services.engine.requests import InvalidRequest
    from services.engine.server import request_from_proto
    from tests.engine.conftest import templated_model_dir

    template = ("{%- for m in messages -%}<|im_start|>{{ m.role }}"
                "{% if m.name and m.role == 'user' %} ({{ m.name }}){% endif %}\n"
                "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
                "{{ m.content }}<|im_end|>\n{%- endfor -%}<|im_start|>assistant\n")
    runner = ModelRunner(templated_model_dir(tmp_path / "named", template), cache_slots=0,
                         reserved_bytes=0)
    engine = Engine(runner)

    def prompt(*messages: engine_pb2.ChatMessage) -> str:
        req = request_from_proto(engine_pb2.GenerateRequest(
            sampling=engine_pb2.SamplingParams(max_tokens=2),
            chat=engine_pb2.ChatInput(messages=messages)))
        return runner.tokenizer.decode(engine._tokenize(req), skip_special_tokens=False)

    text = prompt(engine_pb2.ChatMessage(role="user", content="hi", name="ada"),
                  engine_pb2.ChatMessage(role="assistant", content="hello",
                                         reasoning_content="greet back"),
                  engine_pb2.ChatMessage(role="user", content="bye"))
    assert "user (ada)" in text and "<think>greet back</think>hello" in text
    # gpt-oss's template reads an assistant's reasoning as `thinking`
    thinking = templated_model_dir(tmp_path / "thinking", template.replace(
        "m.reasoning_content", "m.thinking"))
    engine_oss = Engine(ModelRunner(thinking, cache_slots=0, reserved_bytes=0))
    oss_text = engine_oss.runner.tokenizer.decode(engine_oss._tokenize(request_from_proto(
        engine_pb2.GenerateRequest(sampling=engine_pb2.SamplingParams(max_tokens=2),
                                   chat=engine_pb2.ChatInput(messages=[
                                       engine_pb2.ChatMessage(role="user", content="hi"),
                                       engine_pb2.ChatMessage(role="assistant", content="hello",
                                                              reasoning_content="greet back"),
                                       engine_pb2.ChatMessage(role="user", content="bye")])))),
        skip_special_tokens=False)
    assert "<think>greet back</think>hello" in oss_text
    with pytest.raises(InvalidRequest) as caught:
        prompt(engine_pb2.ChatMessage(role="user", content="hi"),
               engine_pb2.ChatMessage(role="assistant", content="hello", name="bot"))
    assert (caught.value.param, caught.value.code) == ("messages[1].name",
                                                       "unsupported_parameter")
