"""The GenAI request instruments, read back through an in-memory reader and a scrape."""

import urllib.request

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client.parser import text_string_to_metric_families

from services.common.genai_metrics import (
    REQUEST_DURATION_BUCKETS,
    TIME_PER_OUTPUT_TOKEN_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
    TOKEN_USAGE_BUCKETS,
    GenAIMetrics,
)
from services.common.telemetry import setup_metrics


def collect(reader):
    out = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                out[metric.name] = metric
    return out


def test_instruments_units_buckets_and_values():
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    metrics = GenAIMetrics(provider.get_meter("strata.gateway"))
    metrics.record_request("tiny-moe", 1.5, time_to_first_token_s=0.3, input_tokens=26,
                           output_tokens=7)
    metrics.record_request("tiny-moe", 0.05, error_type="queue_full")
    metrics.set_load(running=3, waiting=2, kv_usage=0.25)
    got = collect(reader)
    provider.shutdown()

    expected = {
        "gen_ai.server.request.duration": ("s", REQUEST_DURATION_BUCKETS),
        "gen_ai.server.time_to_first_token": ("s", TIME_TO_FIRST_TOKEN_BUCKETS),
        "gen_ai.server.time_per_output_token": ("s", TIME_PER_OUTPUT_TOKEN_BUCKETS),
        "gen_ai.client.token.usage": ("{token}", TOKEN_USAGE_BUCKETS),
    }
    for name, (unit, buckets) in expected.items():
        assert got[name].unit == unit
        for point in got[name].data.data_points:
            assert tuple(point.explicit_bounds) == tuple(buckets)
    assert TIME_TO_FIRST_TOKEN_BUCKETS[:3] == (0.001, 0.005, 0.01)
    assert TOKEN_USAGE_BUCKETS[-1] == 67108864 and REQUEST_DURATION_BUCKETS[-1] == 81.92

    durations = {p.attributes.get("error.type"): p for p in
                 got["gen_ai.server.request.duration"].data.data_points}
    assert durations[None].sum == 1.5 and durations["queue_full"].sum == 0.05
    assert dict(durations[None].attributes) == {
        "gen_ai.operation.name": "chat", "gen_ai.provider.name": "strata",
        "gen_ai.request.model": "tiny-moe"}
    (ttft,) = got["gen_ai.server.time_to_first_token"].data.data_points
    assert ttft.count == 1 and ttft.sum == 0.3  # the failed request is not in it
    (tpot,) = got["gen_ai.server.time_per_output_token"].data.data_points
    assert tpot.sum == pytest.approx((1.5 - 0.3) / 6)
    usage = {p.attributes["gen_ai.token.type"]: p.sum
             for p in got["gen_ai.client.token.usage"].data.data_points}
    assert usage == {"input": 26, "output": 7}
    gauges = {name: got[name].data.data_points[0].value for name in (
        "strata.requests.running", "strata.requests.waiting", "strata.kv_cache.usage")}
    assert gauges == {"strata.requests.running": 3, "strata.requests.waiting": 2,
                      "strata.kv_cache.usage": 0.25}
    assert got["strata.requests.running"].unit == "{request}"


def test_prometheus_names():
    provider = setup_metrics("svc", 0, "127.0.0.1")
    try:
        metrics = GenAIMetrics(provider.get_meter("strata.engine"), operation="text_completion")
        metrics.record_request("m", 0.5, time_to_first_token_s=0.1, input_tokens=3,
                               output_tokens=5)
        metrics.set_load(1, 0)
        text = urllib.request.urlopen(
            f"http://127.0.0.1:{provider.prometheus_port}/metrics", timeout=5).read().decode()
    finally:
        provider.shutdown()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("gen_ai_server_time_to_first_token_seconds",
                 "gen_ai_server_time_per_output_token_seconds",
                 "gen_ai_server_request_duration_seconds", "gen_ai_client_token_usage"):
        assert families[name].type == "histogram", name
    buckets = [s for s in families["gen_ai_server_time_to_first_token_seconds"].samples
               if s.name.endswith("_bucket")]
    assert [s.labels["le"] for s in buckets][:2] == ["0.001", "0.005"]
    assert buckets[0].labels["gen_ai_operation_name"] == "text_completion"
    assert "strata_requests_running" in families and "strata_kv_cache_usage" not in families
