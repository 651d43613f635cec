"""The gateway's request metrics (GenAI conventions) on its Prometheus endpoint, parsed with
prometheus_client, and its server span as the parent the engine is told about."""

from __future__ import annotations

import asyncio
import urllib.request

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from services.common.telemetry import setup_metrics, setup_tracing
from services.gateway.app import init_app
from services.gateway.config import GatewayConfig

from .conftest import MODEL
from .test_overload import _wait_for

MESSAGES = [{"role": "user", "content": "hello there"}]


class FakeClock:
    """The gateway's monotonic clock, moved only by the test: every duration it measures is the
    time the test let pass."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def scrape(port: int) -> list[tuple[str, dict[str, str], float]]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text)
            for s in family.samples]


def value(samples, name: str, **labels) -> float:
    found = [v for n, got, v in samples if n == name and labels.items() <= got.items()]
    assert len(found) == 1, (name, labels, [s for s in samples if s[0] == name])
    return found[0]


@pytest.fixture
async def observed_gateway(engine):
    _, address = engine
    meter_provider = setup_metrics("strata-gateway", 0, "127.0.0.1")
    spans = InMemorySpanExporter()
    tracer_provider = setup_tracing("strata-gateway", [SimpleSpanProcessor(spans)])
    config = GatewayConfig(host="127.0.0.1", port=0, engine_addrs=(address,),
                           health_interval_s=0.2, engine_timeout_s=1.0)
    clock = FakeClock()
    runner = web.AppRunner(init_app(config, meter_provider=meter_provider,
                                    tracer_provider=tracer_provider, clock=clock))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    yield f"http://{host}:{port}", meter_provider.prometheus_port, spans, clock
    await runner.cleanup()
    meter_provider.shutdown()
    tracer_provider.shutdown()


async def _chat_held_for(http, base, servicer, clock, seconds):
    """A chat completion whose first token the engine holds while `seconds` pass on the
    gateway's clock; the rest follow at once (no time passes)."""
    servicer.hold = asyncio.Event()
    reply = asyncio.create_task(http.post(base + "/v1/chat/completions",
                                          json={"model": MODEL, "messages": MESSAGES}))
    await _wait_for(lambda: servicer.running == 1)  # Started sent, the tokens held
    clock.now += seconds
    servicer.hold.set()
    async with await reply as r:
        assert r.status == 200
        return (await r.json())["usage"]


async def test_known_requests_give_the_genai_metrics(observed_gateway, engine):
    base, metrics_port, _, clock = observed_gateway
    servicer, _ = engine
    async with aiohttp.ClientSession() as http:
        usage = await _chat_held_for(http, base, servicer, clock, 0.3)
        servicer.hold = None  # no time passes for the next two
        async with http.post(base + "/v1/completions",
                             json={"model": MODEL, "prompt": "one two", "max_tokens": 2}) as r:
            assert r.status == 200
        async with http.post(base + "/v1/chat/completions",
                             json={"model": "no-such-model", "messages": MESSAGES}) as r:
            assert r.status == 404
    samples = scrape(metrics_port)
    chat = {"gen_ai_operation_name": "chat", "gen_ai_provider_name": "strata",
            "gen_ai_request_model": MODEL}
    assert value(samples, "gen_ai_server_request_duration_seconds_count", **chat) == 1
    assert value(samples, "gen_ai_server_time_to_first_token_seconds_count", **chat) == 1
    assert value(samples, "gen_ai_server_time_per_output_token_seconds_count", **chat) == 1
    assert value(samples, "gen_ai_client_token_usage_sum", gen_ai_token_type="input",
                 **chat) == usage["prompt_tokens"]
    assert value(samples, "gen_ai_client_token_usage_sum", gen_ai_token_type="output",
                 **chat) == usage["completion_tokens"] == len(servicer.tokens)
    # 0.3 s to the first token and to the end: in the buckets either side of 0.3 exactly
    ttft = "gen_ai_server_time_to_first_token_seconds"
    assert [value(samples, f"{ttft}_bucket", le=le, **chat) for le in ("0.25", "0.5")] == [0, 1]
    assert value(samples, f"{ttft}_sum", **chat) == pytest.approx(0.3)
    duration = "gen_ai_server_request_duration_seconds"
    assert [value(samples, f"{duration}_bucket", le=le, **chat) for le in ("0.16", "0.32")] == [
        0, 1]
    assert value(samples, f"{duration}_sum", **chat) == pytest.approx(0.3)
    tpot = "gen_ai_server_time_per_output_token_seconds"
    assert value(samples, f"{tpot}_bucket", le="0.01", **chat) == 1  # the rest took no time
    assert value(samples, f"{tpot}_sum", **chat) == 0
    completion = chat | {"gen_ai_operation_name": "text_completion"}
    assert value(samples, f"{ttft}_bucket", le="0.001", **completion) == 1  # none passed
    assert value(samples, "gen_ai_client_token_usage_sum", gen_ai_token_type="output",
                 **completion) == 2
    assert value(samples, "gen_ai_server_request_duration_seconds_count",
                 error_type="ModelNotFound") == 1
    assert not [s for s in samples if s[0].startswith("gen_ai_server_time_to_first")
                and s[1].get("error_type")]
    assert value(samples, "strata_requests_running") == 0
    assert value(samples, "strata_requests_waiting") == 0


async def test_the_server_span_is_the_engines_parent(observed_gateway, engine):
    base, _, spans, _ = observed_gateway
    servicer, _ = engine
    async with (aiohttp.ClientSession() as http,
                http.post(base + "/v1/chat/completions",
                          json={"model": MODEL, "messages": MESSAGES, "user": "user-42"},
                          headers={"X-Request-Id": "m-1"}) as r):
        assert r.status == 200
    [span] = [s for s in spans.get_finished_spans()
              if s.attributes.get("strata.request_id") == "m-1"]
    assert span.name == "POST /v1/chat/completions"
    assert span.attributes["http.response.status_code"] == 200
    assert span.attributes["gen_ai.request.model"] == MODEL
    assert span.attributes["user.id"] == "user-42"  # the request's `user`
    _, trace_id, span_id, _ = servicer.metadata["m-1"]["traceparent"].split("-")
    assert (int(trace_id, 16), int(span_id, 16)) == (span.context.trace_id, span.context.span_id)
    # OpenAI's current name for it, on every generation endpoint; it wins over `user`
    for path, body in (("/v1/chat/completions", {"messages": MESSAGES}),
                       ("/v1/completions", {"prompt": "hi"}), ("/v1/responses", {"input": "hi"})):
        async with (aiohttp.ClientSession() as http,
                    http.post(base + path, json={"model": MODEL, "user": "old",
                                                 "safety_identifier": "user-43", **body},
                              headers={"X-Request-Id": "m-2"}) as r):
            assert r.status == 200
        [span] = [s for s in spans.get_finished_spans()
                  if s.attributes.get("strata.request_id") == "m-2"]
        assert span.attributes["user.id"] == "user-43", path
        spans.clear()


async def test_a_reasoning_summarys_tokens_count_as_output(observed_gateway, engine):
    """reasoning.summary: the summary's tokens are in usage.output_tokens and in the output
    token usage metric alike."""
    from .test_responses_api import SUMMARY, THOUGHT, _summaries

    base, metrics_port, _, _ = observed_gateway
    servicer, _ = engine
    servicer.tool_call_format = "harmony"
    servicer.tokens = [*THOUGHT, "<|start|>assistant<|channel|>final<|message|>", "Done."]
    servicer.tokens_for, servicer.context_window = _summaries, 1000
    async with aiohttp.ClientSession() as http, http.post(base + "/v1/responses", json={
            "model": MODEL, "input": "hi", "reasoning": {"summary": "auto"}}) as r:
        usage = (await r.json())["usage"]
    assert usage["output_tokens"] == len(servicer.tokens) + len(SUMMARY)
    samples = scrape(metrics_port)
    assert value(samples, "gen_ai_client_token_usage_sum", gen_ai_token_type="output",
                 gen_ai_operation_name="chat") == usage["output_tokens"]
