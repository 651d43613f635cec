"""Observability end to end: one trace from the gateway through a real engine, received by an
in-process OTLP receiver; the request metrics on the gateway's and the engine's Prometheus
endpoints of a `strata up` cluster, parsed with prometheus_client."""

from __future__ import annotations

import re
import threading
import urllib.request
from concurrent import futures

import grpc
import openai
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from services.common.telemetry import setup_tracing
from services.engine.core import Engine
from services.engine.model.demo import write_demo_checkpoint
from services.engine.runner import ModelRunner
from services.engine.server import StatusSource, set_serving, start_server
from services.gateway.app import init_app
from services.gateway.config import GatewayConfig
from services.models import DEFAULT_MODEL_NAME

pytestmark = pytest.mark.e2e

PROMPT = [{"role": "user", "content": "Name three prime numbers."}]


class TraceReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list = []  # (service name, span)
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                service = {a.key: a.value.string_value
                           for a in resource_spans.resource.attributes}["service.name"]
                for scope in resource_spans.scope_spans:
                    self.spans += [(service, span) for span in scope.spans]
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def otlp_traces(monkeypatch):
    receiver = TraceReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    yield receiver
    server.stop(0)


@pytest.fixture
async def engine_address(tmp_path):
    model_dir = write_demo_checkpoint(
        tmp_path / "tiny-demo", seed=1, num_hidden_layers=2, hidden_size=64,
        intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=512, vocab_size=320)
    runner = ModelRunner(model_dir, device_memory_bytes=64 * 2**20, reserved_bytes=0)
    runner.fill_cache(runner.layer_order_pairs())
    engine = Engine(runner)
    status = StatusSource(engine, "engine-0", runner.model_name, "cpu")
    tracer_provider = setup_tracing("strata-engine")  # OTLP, from the environment
    server, port, health = await start_server(engine, status, "127.0.0.1", 0,
                                              tracer_provider=tracer_provider)
    engine.start()
    await set_serving(health, True)
    yield f"127.0.0.1:{port}", runner.model_name, tracer_provider
    await server.stop(grace=None)
    engine.stop()
    tracer_provider.shutdown()  # flushes the batch to the receiver


async def test_one_trace_from_gateway_through_the_engine(otlp_traces, engine_address):
    address, model, engine_tracing = engine_address
    gateway_tracing = setup_tracing("strata-gateway")
    config = GatewayConfig(host="127.0.0.1", port=0, engine_addrs=(address,),
                           health_interval_s=0.2)
    runner = web.AppRunner(init_app(config, tracer_provider=gateway_tracing))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        async with openai.AsyncOpenAI(base_url=f"http://{host}:{port}/v1", api_key="unused",
                                      max_retries=0) as client:
            reply = await client.chat.completions.create(model=model, messages=PROMPT,
                                                         max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens >= 1
    finally:
        await runner.cleanup()
        gateway_tracing.shutdown()
    engine_tracing.force_flush()
    spans = {service: [s for svc, s in otlp_traces.spans if svc == service]
             for service in ("strata-gateway", "strata-engine")}
    [gateway] = [s for s in spans["strata-gateway"] if s.name == "POST /v1/chat/completions"]
    [engine] = [s for s in spans["strata-engine"] if s.name == "generate"]
    assert engine.trace_id == gateway.trace_id  # one trace id across both services
    assert engine.parent_span_id == gateway.span_id


def metrics_urls(cluster) -> dict[str, str]:
    line = re.search(r"strata up: metrics: (.*)", cluster.output.read_text()).group(1)
    return dict(re.findall(r"(\w+) (http://\S+/metrics)", line))


def samples(url: str) -> list[tuple[str, dict[str, str], float]]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text)
            for s in family.samples]


def test_gateway_and_engine_export_the_genai_request_metrics(cluster):
    urls = metrics_urls(cluster)
    assert set(urls) == {"cachemgr", "gateway", "engine"}
    client = openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0)
    before = {name: sum(v for n, labels, v in samples(url)
                        if n == "gen_ai_client_token_usage_sum"
                        and labels.get("gen_ai_token_type") == "output")
              for name, url in urls.items() if name != "cachemgr"}
    reply = client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=PROMPT,
                                           max_tokens=5, temperature=0)
    for name in ("gateway", "engine"):
        got = samples(urls[name])
        output = sum(v for n, labels, v in got if n == "gen_ai_client_token_usage_sum"
                     and labels.get("gen_ai_token_type") == "output")
        assert output - before[name] == reply.usage.completion_tokens, name
        ttft = [(labels, v) for n, labels, v in got
                if n == "gen_ai_server_time_to_first_token_seconds_count"]
        assert ttft and all(labels["gen_ai_request_model"] == DEFAULT_MODEL_NAME
                            for labels, _ in ttft), name
        assert any(n == "strata_requests_running" for n, _, _ in got), name
    engine = samples(urls["engine"])
    assert [v for n, _, v in engine if n == "strata_kv_cache_usage"]
