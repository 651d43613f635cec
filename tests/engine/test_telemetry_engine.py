"""The engine's telemetry on a real gRPC server: GenAI request metrics and load gauges on its
Prometheus endpoint (parsed with prometheus_client), the per-request log line with request and
trace ids, the span continuing the caller's trace, and the optional RoutingReport fields the
cache manager turns into prefetch precision and link bandwidth."""

from __future__ import annotations

import logging
import urllib.request

import grpc
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from services.cachemgr.config import CacheMgrConfig
from services.cachemgr.daemon import start_daemon
from services.common.pb.strata.v1 import engine_pb2, engine_pb2_grpc
from services.common.telemetry import setup_metrics, setup_tracing
from services.engine.core import Engine
from services.engine.planning import CacheManagerLink
from services.engine.runner import ModelRunner
from services.engine.server import StatusSource, set_serving, start_server

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


def scrape(port: int) -> dict[str, list]:
    """{family name: [(sample name, labels, value), ...]} without the otel_scope labels."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        out[family.name] = [(s.name, {k: v for k, v in s.labels.items()
                                      if not k.startswith("otel_scope")}, s.value)
                            for s in family.samples]
    return out


def sample(families: dict[str, list], name: str, **labels) -> float:
    family = name.removesuffix("_count").removesuffix("_sum")
    found = [v for n, got, v in families[family] if n == name
             and labels.items() <= got.items()]
    assert len(found) == 1, (name, labels, families[family])
    return found[0]


@pytest.fixture
async def engine_server(tiny_dir):
    runner = ModelRunner(tiny_dir, cache_slots=12, reserved_bytes=0, prefetch=True)
    runner.fill_cache(runner.layer_order_pairs())
    engine = Engine(runner)
    status = StatusSource(engine, "engine-a", runner.model_name, "cpu")
    meter_provider = setup_metrics("strata-engine", 0, "127.0.0.1")
    spans = InMemorySpanExporter()
    tracer_provider = setup_tracing("strata-engine", [SimpleSpanProcessor(spans)])
    server, port, health = await start_server(engine, status, "127.0.0.1", 0,
                                              meter_provider=meter_provider,
                                              tracer_provider=tracer_provider)
    engine.start()
    await set_serving(health, True)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield engine_pb2_grpc.EngineStub(channel), meter_provider.prometheus_port, spans, runner, engine
    await channel.close()
    await server.stop(grace=None)
    engine.stop()
    meter_provider.shutdown()
    tracer_provider.shutdown()


async def test_request_metrics_log_line_and_span(engine_server, caplog):
    caplog.set_level(logging.INFO)
    stub, metrics_port, spans, runner, _ = engine_server
    request = engine_pb2.GenerateRequest(
        request_id="req-7", prompt="The expert cache",
        sampling=engine_pb2.SamplingParams(max_tokens=6))
    events = [e async for e in stub.Generate(request, metadata=(("traceparent", TRACEPARENT),))]
    stats = events[-1].finished.stats
    assert stats.completion_tokens >= 2

    families = scrape(metrics_port)
    attrs = {"gen_ai_operation_name": "text_completion", "gen_ai_provider_name": "strata",
             "gen_ai_request_model": runner.model_name}
    assert sample(families, "gen_ai_server_request_duration_seconds_count", **attrs) == 1
    assert sample(families, "gen_ai_server_time_to_first_token_seconds_count", **attrs) == 1
    assert sample(families, "gen_ai_server_time_per_output_token_seconds_count", **attrs) == 1
    assert 0 < sample(families, "gen_ai_server_time_to_first_token_seconds_sum", **attrs) < 30
    assert sample(families, "gen_ai_client_token_usage_sum", gen_ai_token_type="input",
                  **attrs) == stats.prompt_tokens
    assert sample(families, "gen_ai_client_token_usage_sum", gen_ai_token_type="output",
                  **attrs) == stats.completion_tokens
    buckets = [labels["le"] for n, labels, _ in families["gen_ai_server_time_to_first_token_seconds"]
               if n.endswith("_bucket")]
    assert buckets[:3] == ["0.001", "0.005", "0.01"]  # the conventions' boundaries
    assert sample(families, "strata_requests_running") == 0
    assert sample(families, "strata_requests_waiting") == 0
    assert 0 <= sample(families, "strata_kv_cache_usage") <= 1  # share of KV blocks in use

    [span] = spans.get_finished_spans()
    assert f"{span.context.trace_id:032x}" == TRACE_ID  # continues the caller's trace
    assert f"{span.parent.span_id:016x}" == "00f067aa0ba902b7"
    assert span.attributes["strata.request_id"] == "req-7"
    assert span.attributes["gen_ai.usage.output_tokens"] == stats.completion_tokens
    lines = [r for r in caplog.records if r.name == "strata.engine"
             and "req-7" in r.getMessage()]
    assert len(lines) == 1 and TRACE_ID in lines[0].getMessage()
    assert (lines[0].request_id, lines[0].trace_id) == ("req-7", TRACE_ID)


async def test_invalid_request_is_counted_with_its_error_type(engine_server):
    stub, metrics_port, _, _, _ = engine_server
    with pytest.raises(grpc.aio.AioRpcError):
        await stub.Generate(engine_pb2.GenerateRequest(request_id="bad", prompt="x " * 600)).read()
    families = scrape(metrics_port)
    assert sample(families, "gen_ai_server_request_duration_seconds_count",
                  error_type="invalid_request") == 1
    assert "gen_ai_server_time_to_first_token_seconds" not in families


async def test_reports_carry_prefetch_link_and_load_figures(engine_server, tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_HOME", str(tmp_path))
    stub, _, _, runner, engine = engine_server
    provider = setup_metrics("strata-cachemgr", 0, "127.0.0.1")
    daemon = await start_daemon(CacheMgrConfig.from_values(
        {"host": "127.0.0.1", "port": 0, "metrics_port": 0, "profile_path": None}),
        meter_provider=provider)
    link = CacheManagerLink(f"127.0.0.1:{daemon.port}", "engine-a", runner)
    try:
        request = engine_pb2.GenerateRequest(request_id="r", prompt="Hello there",
                                             sampling=engine_pb2.SamplingParams(max_tokens=16))
        [e async for e in stub.Generate(request)]
        predicted, used = runner.cache.decode.predicted, runner.cache.decode.predicted_routed
        copies, num_bytes, busy_s = runner.cache.link.totals()
        assert predicted > 0 and copies > 0 and busy_s > 0  # 12 of 24 pairs: misses copied
        assert await link.report(engine.totals, 0, load=(1, 2)) is not None
        [figures] = daemon.manager.snapshot()
        assert figures.prefetch_precision == pytest.approx(used / predicted)
        assert figures.link_bytes_per_s == pytest.approx(num_bytes / busy_s, rel=0.05)
        assert (figures.requests_running, figures.requests_waiting) == (1, 2)
        families = scrape(provider.prometheus_port)
        assert 0 < sample(families, "strata_cache_prefetch_precision",
                          engine_id="engine-a") <= 1
        assert sample(families, "strata_link_bandwidth_bytes_per_second",
                      engine_id="engine-a") > 0
        # Nothing new since: no link figures to divide, prefetch counted as zero.
        await link.report(engine.totals, 0)
    finally:
        await link.close()
        await daemon.stop(grace_s=1)
        provider.shutdown()
