"""OpenTelemetry setup shared by the services: metrics, traces, and W3C context over gRPC.

    provider = setup_metrics("strata-cachemgr", prometheus_port=9464)
    meter = provider.get_meter("strata.cachemgr")
    ...
    provider.shutdown()          # flushes OTLP and stops the scrape endpoint

Readers: a Prometheus scrape endpoint (`GET http://HOST:PORT/metrics`) when a port is given, and
an OTLP exporter when `OTEL_EXPORTER_OTLP_ENDPOINT` is set; both may be on. The provider is
returned, never installed as the global one, so a process (a test run) may set up several; callers
pass it to whatever creates instruments. Each provider has its own Prometheus registry.

Traces:

    tracer_provider = setup_tracing("strata-gateway")   # OTLP when OTEL_EXPORTER_OTLP_ENDPOINT
    tracer = tracer_provider.get_tracer("strata.gateway")
    with tracer.start_as_current_span("chat") as span:
        metadata = inject_metadata()                      # [("traceparent", ...)] for grpc
    ...                                                   # the engine, in its servicer:
    with tracer.start_as_current_span("generate", context=extract_context(
            context.invocation_metadata())):
        ...
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from wsgiref.simple_server import WSGIServer

from opentelemetry import context as otel_context
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger("strata.telemetry")


class StrataMeterProvider(MeterProvider):
    """A MeterProvider that also owns its Prometheus HTTP endpoint (if any)."""

    def __init__(self, *args, http_server: WSGIServer | None = None,
                 http_thread: threading.Thread | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.readers: tuple[MetricReader, ...] = tuple(kwargs.get("metric_readers", ()))
        self._http_server = http_server
        self._http_thread = http_thread

    @property
    def prometheus_port(self) -> int | None:
        """The bound scrape port (useful with prometheus_port=0), None without an endpoint."""
        return self._http_server.server_address[1] if self._http_server else None

    def shutdown(self, timeout_millis: float = 30_000) -> None:
        if self._http_server is not None:
            self._http_server.shutdown()
            self._http_server.server_close()
            self._http_server = None
        super().shutdown(timeout_millis=timeout_millis)


def setup_metrics(service_name: str, prometheus_port: int | None,
                  prometheus_host: str = "0.0.0.0") -> StrataMeterProvider:
    """A MeterProvider exporting to Prometheus (port given; 0 = any free port) and/or OTLP.

    prometheus_port=None disables the scrape endpoint. OTLP export is on when
    OTEL_EXPORTER_OTLP_ENDPOINT is set (the exporter reads the standard OTEL_* variables).
    """
    readers: list[MetricReader] = []
    http_server = http_thread = None
    if prometheus_port is not None:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry(auto_describe=True)
        readers.append(PrometheusMetricReader(registry=registry))
        http_server, http_thread = start_http_server(prometheus_port, addr=prometheus_host,
                                                     registry=registry)
        log.info("metrics: Prometheus endpoint on http://%s:%d/metrics", prometheus_host,
                 http_server.server_address[1])
    otlp_endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
        log.info("metrics: OTLP export to %s", otlp_endpoint)
    if not readers:
        log.info("metrics: no exporter (no Prometheus port, OTEL_EXPORTER_OTLP_ENDPOINT unset)")
    resource = Resource.create({SERVICE_NAME: service_name})
    return StrataMeterProvider(resource=resource, metric_readers=readers,
                               http_server=http_server, http_thread=http_thread)


def setup_tracing(service_name: str,
                  processors: Iterable[SpanProcessor] = ()) -> TracerProvider:
    """A TracerProvider for the service, exporting over OTLP (gRPC, batched) when
    OTEL_EXPORTER_OTLP_ENDPOINT is set, plus any `processors` given (tests pass an in-memory
    one). Returned, not installed globally; `shutdown()` flushes it."""
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    otlp_endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        log.info("traces: OTLP export to %s", otlp_endpoint)
    for processor in processors:
        provider.add_span_processor(processor)
    return provider


_PROPAGATOR = TraceContextTextMapPropagator()


def inject_metadata(context: otel_context.Context | None = None) -> list[tuple[str, str]]:
    """W3C trace context (`traceparent`, `tracestate`) of the current span, as gRPC metadata."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=context)
    return list(carrier.items())


def extract_context(metadata: Iterable[tuple[str, str | bytes]] | None) -> otel_context.Context:
    """The remote parent carried in gRPC metadata (an empty context when there is none)."""
    carrier = {key.lower(): value for key, value in metadata or ()
               if isinstance(value, str)}
    return _PROPAGATOR.extract(carrier)
