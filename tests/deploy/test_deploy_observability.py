"""The telemetry path of the deployment: OpenTelemetry Collector config, Prometheus scrape
targets and Grafana provisioning agree with each other, with compose.yaml and with deploy/k8s."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from kustomize_render import build
from strata_settings import REPO

DEPLOY = REPO / "deploy"
COMPOSE = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
COLLECTOR = yaml.safe_load((DEPLOY / "otel" / "collector.yaml").read_text())
PROMETHEUS = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def defaults(text: str) -> str:
    return INTERPOLATION.sub(lambda m: m.group(2) or "", str(text))


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def component_type(name: str) -> str:
    return name.split("/", 1)[0]  # `otlp/2` is a second otlp


# --- collector ---------------------------------------------------------------------------------

def test_collector_pipelines_use_defined_components_and_nothing_else():
    service = COLLECTOR["service"]
    used = {"receivers": set(), "processors": set(), "exporters": set()}
    assert service["pipelines"]
    for name, pipeline in service["pipelines"].items():
        assert component_type(name) in {"metrics", "traces", "logs"}, name
        assert pipeline["receivers"] and pipeline["exporters"], name
        for section in used:
            for component in pipeline.get(section, []):
                assert component in (COLLECTOR.get(section) or {}), f"{name}: {component}"
                used[section].add(component)
    for section, names in used.items():
        assert set(COLLECTOR.get(section) or {}) == names, f"unused {section}"
    assert set(service.get("extensions", [])) == set(COLLECTOR.get("extensions") or {})
    metrics = service["pipelines"]["metrics"]
    assert "prometheus" in metrics["exporters"] and "otlp" in metrics["receivers"]
    # memory_limiter first, as the collector's docs require.
    for pipeline in service["pipelines"].values():
        assert pipeline.get("processors", ["memory_limiter"])[0] == "memory_limiter"


def test_collector_components_are_in_the_core_distribution():
    # otel/opentelemetry-collector (core) ships these; anything else needs the contrib image.
    core = {"receivers": {"otlp", "prometheus", "hostmetrics", "jaeger", "zipkin", "kafka",
                          "opencensus", "nop"},
            "processors": {"batch", "memory_limiter", "attributes", "resource", "filter",
                           "probabilistic_sampler", "span"},
            "exporters": {"otlp", "otlphttp", "debug", "prometheus", "prometheusremotewrite",
                          "file", "kafka", "zipkin", "nop"},
            "extensions": {"health_check", "pprof", "zpages"}}
    image = defaults(SERVICES["otel-collector"]["image"])
    assert image.startswith("otel/opentelemetry-collector:")
    for section, allowed in core.items():
        for name in COLLECTOR.get(section) or {}:
            assert component_type(name) in allowed, f"{section}: {name} is not in core"


def test_collector_ports_match_compose_and_kubernetes():
    otlp_grpc = port_of(COLLECTOR["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"])
    otlp_http = port_of(COLLECTOR["receivers"]["otlp"]["protocols"]["http"]["endpoint"])
    exporter = port_of(COLLECTOR["exporters"]["prometheus"]["endpoint"])
    health = port_of(COLLECTOR["extensions"]["health_check"]["endpoint"])
    compose = SERVICES["otel-collector"]
    assert {str(p) for p in (otlp_grpc, otlp_http, exporter, health)} <= set(compose["expose"])
    (config,) = compose["configs"]
    assert COMPOSE["configs"][config["source"]]["file"] == "./otel/collector.yaml"
    assert f"--config={config['target']}" in compose["command"]
    for name, service in SERVICES.items():
        endpoint = (service.get("environment") or {}).get("OTEL_EXPORTER_OTLP_ENDPOINT")
        if endpoint and defaults(endpoint):
            assert defaults(endpoint) == f"http://otel-collector:{otlp_grpc}", name

    docs = build(DEPLOY / "k8s" / "base")
    (svc,) = [d for d in docs if d["kind"] == "Service"
              and d["metadata"]["name"] == "strata-otel-collector"]
    assert {otlp_grpc, otlp_http, exporter} <= {p["port"] for p in svc["spec"]["ports"]}
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"
                     and d["metadata"]["name"] == "strata-otel-collector"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == defaults(compose["image"])
    (arg,) = container["args"]
    (mount,) = container["volumeMounts"]
    (configmap,) = [d for d in docs if d["kind"] == "ConfigMap"
                    and d["metadata"]["name"] == "strata-otel-collector"]
    (key,) = configmap["data"]
    assert arg == f"--config={mount['mountPath']}/{key}"
    assert yaml.safe_load(configmap["data"][key]) == COLLECTOR
    health_ports = {c["containerPort"] for c in container["ports"] if c["name"] == "health"}
    assert health_ports == {health}


# --- prometheus --------------------------------------------------------------------------------

def compose_dns_names(name: str) -> set[str]:
    networks = SERVICES[name].get("networks") or {}
    return {name} | {a for net in networks.values() for a in ((net or {}).get("aliases") or [])}


def listening_ports(name: str) -> set[int]:
    """Ports the service listens on inside the network: expose, published container ports, and
    the Strata ports its environment sets."""
    service = SERVICES[name]
    ports = {int(p) for p in service.get("expose", [])}
    ports |= {int(defaults(p).rsplit(":", 1)[1]) for p in service.get("ports", [])}
    env = service.get("environment") or {}
    ports |= {int(v) for k, v in env.items() if k.endswith("_PORT") and str(v).isdigit()}
    return ports


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_prometheus_targets_are_compose_services_and_ports(profile):
    active = [n for n, s in SERVICES.items() if not s.get("profiles") or profile in s["profiles"]]
    jobs = {job["job_name"]: job for job in PROMETHEUS["scrape_configs"]}
    assert {"strata-cachemgr", "otel-collector"} <= set(jobs)
    for name, job in jobs.items():
        for target in (t for c in job["static_configs"] for t in c["targets"]):
            host, port = target.rsplit(":", 1)
            if host == "localhost":
                assert name == "prometheus"
                continue
            (service,) = [n for n in active if host in compose_dns_names(n)]
            assert int(port) in listening_ports(service), f"{target}: {service} does not listen"
    (cachemgr,) = jobs["strata-cachemgr"]["static_configs"][0]["targets"]
    assert port_of(cachemgr) == int(SERVICES["cachemgr"]["environment"]["STRATA_METRICS_PORT"])
    (collector,) = jobs["otel-collector"]["static_configs"][0]["targets"]
    assert port_of(collector) == port_of(COLLECTOR["exporters"]["prometheus"]["endpoint"])
    assert jobs["otel-collector"]["honor_labels"] is True  # keep job = OTel service.name


def test_cachemgr_metrics_are_scraped_once():
    """Prometheus scrapes the cache manager itself; its OTLP export is off by default, or every
    figure would arrive twice (once per path)."""
    for name in ("cachemgr", "cachemgr-gpu"):
        assert defaults(SERVICES[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"]) == ""
    docs = build(DEPLOY / "k8s" / "base")
    (config,) = [d for d in docs if d["kind"] == "ConfigMap"
                 and d["metadata"]["name"] == "strata-cachemgr"]
    assert config["data"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == ""


def test_prometheus_config_is_mounted_and_matches_the_operator_monitors():
    compose = SERVICES["prometheus"]
    (config,) = compose["configs"]
    assert COMPOSE["configs"][config["source"]]["file"] == "./prometheus/prometheus.yml"
    assert f"--config.file={config['target']}" in compose["command"]
    monitors = build(DEPLOY / "k8s" / "monitoring")
    honor = {d["metadata"]["name"]: d["spec"]["endpoints"][0].get("honorLabels", False)
             for d in monitors if d["kind"] == "ServiceMonitor"}
    assert honor == {"strata-cachemgr": False, "strata-otel-collector": True}


# --- grafana -----------------------------------------------------------------------------------

def test_grafana_is_provisioned_with_the_dashboard_and_its_datasource():
    grafana = SERVICES["grafana"]
    binds = {v["target"]: v["source"] for v in grafana["volumes"] if isinstance(v, dict)}
    provisioning = DEPLOY / binds["/etc/grafana/provisioning"]
    assert provisioning.resolve() == (DEPLOY / "grafana" / "provisioning").resolve()
    (provider,) = yaml.safe_load(
        (provisioning / "dashboards" / "strata.yml").read_text())["providers"]
    dashboards_dir = DEPLOY / binds[provider["options"]["path"]]
    dashboards = list(dashboards_dir.glob("*.json"))
    assert dashboards
    datasources = yaml.safe_load(
        (provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    uids = {d["uid"] for d in datasources}
    for datasource in datasources:
        host, port = re.fullmatch(r"http://([\w-]+):(\d+)", datasource["url"]).groups()
        assert host in SERVICES and int(port) in listening_ports(host) | {9090}
    for path in dashboards:
        text = path.read_text()
        used = set(re.findall(r'"uid":\s*"([^"]+)"', text)) - {json.loads(text)["uid"]}
        assert used <= uids, f"{path.name} uses datasources {used - uids}"
    assert grafana["depends_on"]["prometheus"]["condition"] == "service_healthy"
