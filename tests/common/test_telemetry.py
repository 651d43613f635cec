import asyncio
import threading
import urllib.error
import urllib.request
from concurrent import futures

import grpc
import pytest
from opentelemetry.metrics import Observation
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)
from opentelemetry.proto.collector.trace.v1 import (
    trace_service_pb2,
    trace_service_pb2_grpc,
)
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

from services.common.telemetry import (
    extract_context,
    inject_metadata,
    setup_metrics,
    setup_tracing,
)


def fetch(port):
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def test_two_providers_in_one_process_keep_their_own_endpoints():
    first = setup_metrics("svc-one", 0, "127.0.0.1")
    second = setup_metrics("svc-two", 0, "127.0.0.1")
    first_port = first.prometheus_port
    try:
        first.get_meter("t").create_observable_gauge(
            "strata.test.memory", [lambda _: [Observation(42)]], unit="By")
        second.get_meter("t").create_counter("strata.test.requests", unit="{request}").add(3)
        one, two = fetch(first.prometheus_port), fetch(second.prometheus_port)
        assert 'service_name="svc-one"' in one and "strata_test_memory_bytes" in one
        assert "strata_test_requests_total" not in one
        assert 'service_name="svc-two"' in two and "strata_test_requests_total" in two
    finally:
        first.shutdown()
        second.shutdown()
    with pytest.raises(urllib.error.URLError):
        fetch(first_port)  # shutdown closed the endpoint


def test_no_port_means_no_endpoint_and_otlp_follows_the_environment(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    provider = setup_metrics("svc", None)
    try:
        assert provider.prometheus_port is None
        assert [type(r) for r in provider.readers] == [PeriodicExportingMetricReader]
    finally:
        provider.shutdown(timeout_millis=500)


# --- OTLP: a small in-process receiver (opentelemetry-proto's service definitions) ------------


class OTLPReceiver(metrics_service_pb2_grpc.MetricsServiceServicer,
                   trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every export request it receives."""

    def __init__(self) -> None:
        self.metrics: list = []
        self.spans: list = []
        self.lock = threading.Lock()

    def Export(self, request, context):  # both services share the method name
        with self.lock:
            if isinstance(request, metrics_service_pb2.ExportMetricsServiceRequest):
                self.metrics.append(request)
                return metrics_service_pb2.ExportMetricsServiceResponse()
            for resource_spans in request.resource_spans:
                service = {a.key: a.value.string_value
                           for a in resource_spans.resource.attributes}["service.name"]
                for scope in resource_spans.scope_spans:
                    self.spans += [(service, span) for span in scope.spans]
            return trace_service_pb2.ExportTraceServiceResponse()

    def metric_points(self) -> dict[str, list]:
        """{metric name: [(unit, data point), ...]} over everything received."""
        out: dict[str, list] = {}
        with self.lock:
            for request in self.metrics:
                for rm in request.resource_metrics:
                    for sm in rm.scope_metrics:
                        for metric in sm.metrics:
                            kind = metric.WhichOneof("data")
                            points = getattr(metric, kind).data_points
                            out.setdefault(metric.name, []).extend(
                                (metric.unit, p) for p in points)
        return out


@pytest.fixture
def otlp_receiver(monkeypatch):
    receiver = OTLPReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(receiver, server)
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    yield receiver
    server.stop(0)


async def test_otlp_receives_the_cachemgr_metrics(otlp_receiver, tmp_path, monkeypatch):
    from services.cachemgr.config import CacheMgrConfig
    from services.cachemgr.daemon import start_daemon
    from services.common.pb.strata.v1 import cachemgr_pb2, cachemgr_pb2_grpc, counters_pb2

    monkeypatch.setenv("STRATA_HOME", str(tmp_path))
    provider = setup_metrics("strata-cachemgr", None)  # OTLP only, from the environment
    daemon = await start_daemon(CacheMgrConfig.from_values({"port": 0, "metrics_port": 0}),
                                meter_provider=provider)
    model = cachemgr_pb2.ModelShape(fingerprint="f00d", num_layers=2, num_experts=4,
                                    slot_bytes=2**20)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
            stub = cachemgr_pb2_grpc.CacheManagerStub(channel)
            await stub.ReportRouting(cachemgr_pb2.RoutingReport(
                engine_id="e1", model=model, counts=[0, 5, 0, 0, 0, 0, 3, 0],
                decode=counters_pb2.CacheCounters(lookups=100, hits=97, misses_host=3),
                tokens_generated=10, slots=3))
        await asyncio.to_thread(provider.force_flush)
    finally:
        await daemon.stop(grace_s=1)
        provider.shutdown()
    points = otlp_receiver.metric_points()
    unit, point = points["strata.cache.hit_ratio"][-1]
    assert unit == "1" and point.as_double == pytest.approx(0.97)
    assert {a.key: a.value.string_value for a in point.attributes} == {"engine_id": "e1"}
    assert points["strata.cache.lookups"][-1][1].as_int == 100
    assert points["strata.cache.slots"][-1][0] == "{slot}"
    assert points["strata.device.memory.total"][-1][0] == "By"
    assert {"strata.plan.version", "strata.profile.drift", "strata.cache.coverage",
            "strata.cache.spill_ratio"} <= set(points)


def test_one_trace_from_gateway_to_engine_over_otlp(otlp_receiver):
    gateway, engine = setup_tracing("strata-gateway"), setup_tracing("strata-engine")
    try:
        with gateway.get_tracer("strata.gateway").start_as_current_span("chat") as parent:
            metadata = inject_metadata()  # what the gateway sends with its gRPC call
        assert [key for key, _ in metadata] == ["traceparent"]
        with engine.get_tracer("strata.engine").start_as_current_span(
                "generate", context=extract_context(metadata)) as child:
            pass
    finally:
        gateway.shutdown()
        engine.shutdown()
    spans = {service: span for service, span in otlp_receiver.spans}
    assert set(spans) == {"strata-gateway", "strata-engine"}
    trace_id = parent.get_span_context().trace_id.to_bytes(16, "big")
    assert spans["strata-gateway"].trace_id == spans["strata-engine"].trace_id == trace_id
    assert spans["strata-engine"].parent_span_id == spans["strata-gateway"].span_id
    assert child.get_span_context().trace_id == parent.get_span_context().trace_id


def test_tracing_without_an_endpoint_exports_nothing(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    provider = setup_tracing("svc")
    with provider.get_tracer("t").start_as_current_span("s"):
        assert dict(inject_metadata())["traceparent"].startswith("00-")
    provider.shutdown()
    assert extract_context([]) is not None


def test_load_gauges_read_their_source_and_an_unknown_model_is_left_out():
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from services.common.genai_metrics import GenAIMetrics

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    metrics = GenAIMetrics(provider.get_meter("t"), operation="text_completion")
    load = [2, 5, None]
    metrics.set_load_source(lambda: tuple(load))
    metrics.record_request("", 0.01, error_type="queue_full")  # refused before parsing
    points = {m.name: m.data.data_points for rm in reader.get_metrics_data().resource_metrics
              for sm in rm.scope_metrics for m in sm.metrics}
    provider.shutdown()
    assert [p.value for p in points["strata.requests.running"]] == [2]
    assert [p.value for p in points["strata.requests.waiting"]] == [5]
    assert "strata.kv_cache.usage" not in points  # the source has no KV figure
    [duration] = points["gen_ai.server.request.duration"]
    assert "gen_ai.request.model" not in duration.attributes
    assert duration.attributes["error.type"] == "queue_full"
