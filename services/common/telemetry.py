"""OpenTelemetry metrics setup shared by the services.

    provider = setup_metrics("strata-cachemgr", prometheus_port=9464)
    meter = provider.get_meter("strata.cachemgr")
    ...
    provider.shutdown()          # flushes OTLP and stops the scrape endpoint

Readers: a Prometheus scrape endpoint (`GET http://HOST:PORT/metrics`) when a port is given, and
an OTLP exporter when `OTEL_EXPORTER_OTLP_ENDPOINT` is set; both may be on. The provider is
returned, never installed as the global one, so a process (a test run) may set up several; callers
pass it to whatever creates instruments. Each provider has its own Prometheus registry.
"""

from __future__ import annotations

import logging
import os
import threading
from wsgiref.simple_server import WSGIServer

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import SERVICE_NAME, Resource

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
