"""The scrape endpoint after known reports, parsed with prometheus_client's parser; device
figures from a fake NVML (the real one is exercised on a GPU machine) and from the host."""

import asyncio
import urllib.request
from types import SimpleNamespace

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_cachemgr_daemon import MODEL, config, plan_request, report

from services.cachemgr.daemon import start_daemon
from services.cachemgr.device import DeviceMonitor, EnergyMeter
from services.common.pb.strata.v1 import cachemgr_pb2, cachemgr_pb2_grpc
from services.common.telemetry import setup_metrics

MiB = 2**20


class FakeNvml:
    """The part of pynvml the monitor calls; power 250 W, energy counter +250 J per second."""

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1

    def __init__(self) -> None:
        self.energy_mj = 5_000_000.0

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetName(self, handle):
        return b"NVIDIA Fake 32GB"

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(total=32 * 2**30, used=20 * 2**30, free=12 * 2**30)

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=89, memory=40)

    def nvmlDeviceGetPowerUsage(self, handle):
        return 250_000  # mW

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return 64

    def nvmlDeviceGetClockInfo(self, handle, clock):
        return 1980  # MHz

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        return self.energy_mj


def scrape(port: int) -> dict[str, dict]:
    """{family name: {"unit", "type", "samples": {(sample name, engine/model/device): value}}}"""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        samples = {}
        for s in family.samples:
            key = s.labels.get("engine_id", s.labels.get("model", s.labels.get("device", "")))
            samples[(s.name, key)] = s.value
        out[family.name] = {"unit": family.unit, "type": family.type, "samples": samples}
    return out


@pytest.fixture
async def provider():
    provider = setup_metrics("strata-cachemgr-test", 0, "127.0.0.1")
    yield provider
    provider.shutdown()


async def test_prometheus_names_units_and_values(provider):
    nvml = FakeNvml()
    daemon = await start_daemon(config(), meter_provider=provider,
                                monitor=DeviceMonitor(nvml))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
            stub = cachemgr_pb2_grpc.CacheManagerStub(channel)
            await stub.GetPlan(plan_request())
            daemon.manager.sample_device(now_s=100.0)
            await stub.ReportRouting(report(
                hot={(3, 7): 40}, lookups=1000, hits=865, tokens_generated=50,
                prefetched=200, prefetch_used=150, link_bytes=13_900_000_000, link_busy_s=1.0,
                requests_running=2, requests_waiting=1, slots=4, plan_version=2))
            nvml.energy_mj += 100_000  # 100 J for the 50 tokens
            daemon.manager.sample_device(now_s=101.0)
            overview = await stub.GetOverview(cachemgr_pb2.OverviewRequest())
            families = await asyncio.to_thread(scrape, provider.prometheus_port)
    finally:
        await daemon.stop(grace_s=1)

    def value(family, key="engine-a", sample=None):
        return families[family]["samples"][(sample or family, key)]

    expected = {  # family: (type, unit)
        "strata_cache_slots": ("gauge", ""), "strata_cache_coverage": ("gauge", ""),
        "strata_cache_lookups": ("counter", ""), "strata_cache_hit_ratio": ("gauge", ""),
        "strata_cache_spill_ratio": ("gauge", ""),
        "strata_cache_prefetch_precision": ("gauge", ""),
        "strata_link_bandwidth_bytes_per_second": ("gauge", ""),
        "strata_device_memory_total_bytes": ("gauge", "bytes"),
        "strata_device_power_watts": ("gauge", "watts"),
        "strata_device_temperature_celsius": ("gauge", "celsius"),
        "strata_device_sm_clock_hertz": ("gauge", "hertz"),
        "strata_device_energy_joules": ("counter", "joules"),
        "strata_energy_per_token_joules": ("gauge", "joules"),
        "strata_engine_tokens": ("counter", ""), "strata_plan_version": ("gauge", ""),
        "strata_profile_drift": ("gauge", ""), "strata_engine_plan_version": ("gauge", ""),
    }
    for family, (kind, _unit) in expected.items():
        assert families[family]["type"] == kind, family
    assert value("strata_cache_slots") == 4
    assert value("strata_cache_coverage") == pytest.approx(4 / 32)
    assert value("strata_cache_lookups", sample="strata_cache_lookups_total") == 1000
    assert value("strata_cache_hit_ratio") == pytest.approx(0.865)
    assert value("strata_cache_spill_ratio") == pytest.approx(0.135)
    assert value("strata_cache_prefetch_precision") == pytest.approx(0.75)
    assert value("strata_link_bandwidth_bytes_per_second") == pytest.approx(13.9e9)
    assert value("strata_engine_requests_running") == 2
    assert value("strata_engine_requests_waiting") == 1
    assert value("strata_engine_plan_version") == 2
    assert value("strata_engine_tokens", sample="strata_engine_tokens_total") == 50
    assert value("strata_device_memory_total_bytes", "cuda:0") == 32 * 2**30
    assert value("strata_device_memory_used_bytes", "cuda:0") == 20 * 2**30
    assert value("strata_device_utilization", "cuda:0") == pytest.approx(0.89)
    assert value("strata_device_power_watts", "cuda:0") == 250
    assert value("strata_device_temperature_celsius", "cuda:0") == 64
    assert value("strata_device_sm_clock_hertz", "cuda:0") == 1.98e9
    assert value("strata_device_energy_joules", "cuda:0",
                 "strata_device_energy_joules_total") == pytest.approx(100)
    assert value("strata_energy_per_token_joules", "cuda:0") == pytest.approx(2.0)
    fingerprint = MODEL.fingerprint
    assert value("strata_plan_version", fingerprint) == 2
    assert value("strata_profile_drift", fingerprint) == 0
    assert value("strata_profile_served_ratio", fingerprint) == 1.0
    assert overview.device.name == "NVIDIA Fake 32GB"
    assert overview.device.joules_per_token == pytest.approx(2.0)
    (engine,) = overview.engines
    assert (engine.engine_id, engine.slots, engine.requests_running) == ("engine-a", 4, 2)
    assert engine.prefetch_precision == pytest.approx(0.75)


def test_host_figures_without_a_gpu():
    monitor = DeviceMonitor()
    sample = monitor.sample()
    assert sample.kind == "host" and sample.total_bytes > sample.free_bytes > 0
    assert sample.power_w is None and sample.energy_j is None
    assert 0 <= sample.utilization <= 1


def test_energy_per_token_from_power_samples_without_a_counter():
    nvml = FakeNvml()
    nvml.nvmlDeviceGetTotalEnergyConsumption = None  # older GPUs: no counter -> integrate
    monitor, meter = DeviceMonitor(nvml), EnergyMeter(window_s=10)
    for second, tokens in enumerate((0, 100, 200, 300)):
        meter.add(float(second), monitor.sample(float(second)).energy_j, tokens)
    assert meter.joules_per_token() == pytest.approx(2.5)  # 250 W at 100 tok/s
    for second in range(4, 30):
        meter.add(float(second), monitor.sample(float(second)).energy_j, 300)  # idle
    assert meter.joules_per_token() is None
