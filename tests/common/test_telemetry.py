import urllib.error
import urllib.request

import pytest
from opentelemetry.metrics import Observation
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

from services.common.telemetry import setup_metrics


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
