"""deploy/prometheus and deploy/grafana: they parse, agree with each other, and every metric the
dashboard queries is one the code exports under that exact name on a scrape endpoint."""

import asyncio
import json
import re
import urllib.request
from pathlib import Path

import grpc
import yaml
from prometheus_client.parser import text_string_to_metric_families
from test_cachemgr_daemon import config, plan_request, report
from test_cachemgr_metrics import FakeNvml

from services.cachemgr.daemon import start_daemon
from services.cachemgr.device import DeviceMonitor
from services.common.genai_metrics import GenAIMetrics
from services.common.pb.strata.v1 import cachemgr_pb2_grpc
from services.common.telemetry import setup_metrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = json.loads((DEPLOY / "grafana" / "dashboards" / "strata.json").read_text())
# PromQL words that are not metric names.
PROMQL = {"sum", "rate", "by", "le", "histogram_quantile", "engine_id", "device", "model",
          "avg", "max", "min", "without", "irate", "increase"}


def scrape_names(port: int) -> set[str]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def queried_names() -> set[str]:
    names = set()
    for panel in DASHBOARD["panels"]:
        for target in panel.get("targets", []):
            expr = re.sub(r"\[[^\]]*\]", "", target["expr"])  # drop range selectors
            expr = re.sub(r"\{[^}]*\}", "", expr)  # and label matchers
            names |= {w for w in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr) if w not in PROMQL}
    return names


async def exported_names() -> set[str]:
    provider = setup_metrics("strata-test", 0, "127.0.0.1")
    nvml = FakeNvml()
    daemon = await start_daemon(config(), meter_provider=provider, monitor=DeviceMonitor(nvml))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
            stub = cachemgr_pb2_grpc.CacheManagerStub(channel)
            await stub.GetPlan(plan_request())
            daemon.manager.sample_device(now_s=1.0)
            await stub.ReportRouting(report(
                hot={(1, 1): 3}, lookups=10, hits=9, tokens_generated=10,
                prefetched=4, prefetch_used=3, link_bytes=10, link_busy_s=1.0,
                requests_running=1, requests_waiting=0))
            nvml.energy_mj += 1000
            daemon.manager.sample_device(now_s=2.0)
            GenAIMetrics(provider.get_meter("strata.gateway")).record_request(
                "m", 1.0, time_to_first_token_s=0.1, input_tokens=3, output_tokens=4)
            return await asyncio.to_thread(scrape_names, provider.prometheus_port)
    finally:
        await daemon.stop(grace_s=1)
        provider.shutdown()


async def test_every_queried_metric_is_exported():
    queried, exported = queried_names(), await exported_names()
    assert queried, "no PromQL found"
    assert queried <= exported, sorted(queried - exported)
    # The chain the dashboard exists for.
    for name in ("strata_device_memory_used_bytes", "strata_cache_coverage",
                 "strata_cache_hits_total", "strata_cache_spilled_total",
                 "strata_engine_tokens_total", "gen_ai_server_time_to_first_token_seconds_bucket",
                 "strata_requests_waiting", "strata_energy_per_token_joules"):
        assert name in queried, name


def test_provisioning_agrees_with_the_dashboard():
    prometheus = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = [t for job in prometheus["scrape_configs"] for c in job["static_configs"]
               for t in c["targets"]]
    assert "cachemgr:9464" in targets
    datasources = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["url"].startswith("http://prometheus:")
    providers = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "dashboards" / "strata.yml").read_text())
    assert providers["providers"][0]["type"] == "file"
    assert DASHBOARD["uid"] and DASHBOARD["title"] == "Strata"
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    for panel in DASHBOARD["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == source["uid"], panel["title"]
            assert panel["targets"] and panel["fieldConfig"]["defaults"]["unit"]
