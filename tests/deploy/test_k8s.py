"""Static checks of the Kubernetes manifests (deploy/k8s), without a cluster or kustomize.

Each overlay is rendered by a small pure-Python kustomize (kustomize_render.py), then checked:
schema (kubernetes-validate's bundled OpenAPI schemas, when installed), cross-references
(Services -> pods -> ports, probes -> ports and routes, ConfigMaps/Secrets/PVCs, HPA -> workload
and the adapter's metric), and that every STRATA_* variable a container gets is one the service
it runs declares in its config module.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from kustomize_render import WORKLOADS, build, kustomization, pod_spec
from strata_settings import REPO, SERVICES, accepted

K8S = REPO / "deploy" / "k8s"
OVERLAYS = ["overlays/gpu", "overlays/cpu"]
RENDERED = {name: build(K8S / name) for name in ["base", *OVERLAYS, "monitoring"]}
NAMESPACE = "strata"
# Objects an overlay expects the operator to create (docs/deploy.md says how).
EXTERNAL = {"base": {("Secret", "strata-api-keys"), ("PersistentVolumeClaim", "strata-model")},
            "overlays/gpu": {("Secret", "strata-api-keys")}, "overlays/cpu": set()}
# Custom resources whose schemas are not bundled with Kubernetes.
CRD_KINDS = {"ServiceMonitor", "PodMonitor"}
KUBERNETES_VERSION = "1.31.0"


def kustomization_dirs() -> list[Path]:
    return sorted(p.parent for p in (REPO / "deploy").rglob("kustomization.yaml"))


def find(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def containers(docs: list[dict]):
    for doc in docs:
        if spec := pod_spec(doc):
            for container in spec.get("containers", []):
                yield doc, spec, container


def strata_containers(docs: list[dict]):
    """(workload, pod spec, container, service) for containers running `strata <service>`."""
    for doc, spec, container in containers(docs):
        args = container.get("args") or []
        if container["image"].startswith("strata") and args and args[0] in SERVICES:
            yield doc, spec, container, args[0]


def container_env(docs: list[dict], container: dict) -> dict[str, str | None]:
    """What the container's environment holds: envFrom ConfigMaps in order, then env."""
    env: dict[str, str | None] = {}
    for source in container.get("envFrom", []):
        ref = source.get("configMapRef")
        assert ref, "envFrom: only ConfigMaps are expected"
        env.update(find(docs, "ConfigMap", ref["name"])["data"])
    for item in container.get("env", []):
        env[item["name"]] = item.get("value")
    return env


def container_port(container: dict, port: int | str) -> int:
    """The container port a probe/targetPort means; fails when the container declares none."""
    for declared in container.get("ports", []):
        if port in (declared["containerPort"], declared.get("name")):
            return declared["containerPort"]
    raise AssertionError(f"{container['name']}: no container port {port!r}")


# --- files -------------------------------------------------------------------------------------

@pytest.mark.parametrize("directory", kustomization_dirs(),
                         ids=lambda p: str(p.relative_to(REPO)))
def test_every_kustomization_builds_from_files_that_exist(directory):
    assert build(directory), f"{directory} renders nothing"


def test_every_manifest_parses_and_names_itself():
    files = [p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml"
             and p.name != "prometheus-adapter-values.yaml"]
    assert len(files) >= 8
    for path in files:
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc, f"{path}: empty document"
            assert {"apiVersion", "kind", "metadata"} <= set(doc), path
            assert doc["metadata"].get("name"), path


def test_base_lists_every_manifest_in_its_directory():
    listed = set(kustomization(K8S / "base")["resources"])
    present = {p.name for p in (K8S / "base").glob("*.yaml") if p.name != "kustomization.yaml"}
    assert present <= listed, f"not in base/kustomization.yaml: {sorted(present - listed)}"


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS, "monitoring"])
def test_kubernetes_schema(overlay):
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    checked = 0
    for doc in RENDERED[overlay]:
        if doc["kind"] in CRD_KINDS:
            continue
        kv.validate(doc, KUBERNETES_VERSION, strict=True)
        checked += 1
    assert checked


def test_schema_check_rejects_a_broken_manifest():
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    broken = find(build(K8S / "base"), "StatefulSet", "strata-engine")
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "grpc"
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS, "monitoring"])
def test_everything_lands_in_the_strata_namespace(overlay):
    for doc in RENDERED[overlay]:
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == NAMESPACE, doc["metadata"]["name"]


# --- references --------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_referenced_configmaps_secrets_and_claims_exist(overlay):
    docs = RENDERED[overlay]
    have = {(d["kind"], d["metadata"]["name"]) for d in docs} | EXTERNAL[overlay]
    for _, _spec, container in containers(docs):
        for source in container.get("envFrom", []):
            assert ("ConfigMap", source["configMapRef"]["name"]) in have
    for doc in docs:
        for volume in (pod_spec(doc) or {}).get("volumes", []):
            if "configMap" in volume:
                assert ("ConfigMap", volume["configMap"]["name"]) in have, volume
            if "secret" in volume:
                assert ("Secret", volume["secret"]["secretName"]) in have, volume
            if "persistentVolumeClaim" in volume:
                assert ("PersistentVolumeClaim",
                        volume["persistentVolumeClaim"]["claimName"]) in have, volume


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_volume_mounts_name_declared_volumes(overlay):
    for doc, spec, container in containers(RENDERED[overlay]):
        volumes = {v["name"] for v in spec.get("volumes", [])} | {
            c["metadata"]["name"] for c in doc["spec"].get("volumeClaimTemplates", [])}
        for mount in container.get("volumeMounts", []):
            assert mount["name"] in volumes, f"{doc['metadata']['name']}: {mount['name']}"


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_services_select_pods_and_target_their_ports(overlay):
    docs = RENDERED[overlay]
    for service in (d for d in docs if d["kind"] == "Service"):
        selector = service["spec"]["selector"]
        pods = [(doc, spec) for doc in docs if (spec := pod_spec(doc))
                and selector.items() <= doc["spec"]["template"]["metadata"]["labels"].items()]
        assert pods, f"Service {service['metadata']['name']} selects no pods"
        for port in service["spec"]["ports"]:
            for _, spec in pods:
                assert any(container_port(c, port["targetPort"]) for c in spec["containers"])


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_workload_selectors_match_their_pod_labels(overlay):
    for doc in RENDERED[overlay]:
        if doc["kind"] in WORKLOADS:
            labels = doc["spec"]["template"]["metadata"]["labels"]
            assert doc["spec"]["selector"]["matchLabels"].items() <= labels.items()


def gateway_routes() -> set[str]:
    source = (REPO / "services" / "gateway" / "app.py").read_text()
    return set(re.findall(r'add_get\("([^"]+)"', source))


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_probes_point_at_real_ports_and_routes(overlay):
    routes = gateway_routes()
    for _doc, _spec, container in containers(RENDERED[overlay]):
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container.get(kind)
            if not probe:
                continue
            if "grpc" in probe:
                assert isinstance(probe["grpc"]["port"], int)  # the API takes a number only
                container_port(container, probe["grpc"]["port"])
            for handler in ("httpGet", "tcpSocket"):
                if handler in probe:
                    container_port(container, probe[handler]["port"])
            if "httpGet" in probe and container.get("args", [None])[0] == "gateway":
                assert probe["httpGet"]["path"] in routes


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_engine_and_cachemgr_are_probed_over_grpc_health_and_gateway_cheaply(overlay):
    for _doc, _spec, container, service in strata_containers(RENDERED[overlay]):
        port = int(container_env(RENDERED[overlay], container)[{
            "engine": "STRATA_ENGINE_PORT", "gateway": "STRATA_GATEWAY_PORT",
            "cachemgr": "STRATA_CACHEMGR_PORT"}[service]])
        assert container_port(container, port) == port
        if service == "gateway":
            assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
            assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
        else:
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert container[kind]["grpc"]["port"] == port, f"{service} {kind}"


# --- settings ----------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_containers_get_only_settings_their_service_declares(overlay):
    seen = set()
    for doc, _, container, service in strata_containers(RENDERED[overlay]):
        seen.add(service)
        env = container_env(RENDERED[overlay], container)
        wrong = sorted(n for n in env if n.startswith(("STRATA_", "OTEL_"))
                       and n not in accepted(service))
        assert not wrong, f"{doc['metadata']['name']} ({service}) does not read {wrong}"
    assert seen == set(SERVICES)


def service_port(docs: list[dict], host: str, port: int) -> None:
    """host:port names a Service (short name, or <pod>.<headless service>...) and its port."""
    name = host.split(".")[1] if "$(POD_NAME)" in host else host
    service = find(docs, "Service", name)
    assert port in [p["port"] for p in service["spec"]["ports"]], f"{host}:{port}"


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_addresses_in_settings_name_services_and_ports(overlay):
    docs = RENDERED[overlay]
    for _doc, _, container, service in strata_containers(docs):
        env = container_env(docs, container)
        for key in ("STRATA_CACHEMGR_ADDR", "STRATA_ENGINE_ADVERTISE"):
            if env.get(key):
                host, port = env[key].rsplit(":", 1)
                service_port(docs, host, int(port))
        redis = re.fullmatch(r"redis://([\w.-]+):(\d+)/\d+", env["STRATA_REDIS_URL"])
        service_port(docs, redis.group(1), int(redis.group(2)))
        if otlp := env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            host, port = re.fullmatch(r"http://([\w.-]+):(\d+)", otlp).groups()
            service_port(docs, host, int(port))
        if service == "engine":
            assert env["STRATA_ENGINE_ADVERTISE"].endswith(":" + env["STRATA_ENGINE_PORT"])
        if service == "gateway":
            assert env["STRATA_ENGINE_ADDR"] == "none" and env["STRATA_REDIS_URL"]
            assert env["STRATA_API_KEYS_FILE"].startswith(
                next(m["mountPath"] for m in container["volumeMounts"]
                     if m["name"] == "api-keys") + "/")


def test_api_key_file_of_the_cpu_overlay_is_the_compose_demo_file():
    from services.gateway.config import load_key_file

    overlay_file = K8S / "overlays" / "cpu" / "api-keys.sha256"
    assert overlay_file.read_text() == (REPO / "deploy/secrets/api-keys.sha256").read_text()
    assert len(load_key_file(str(overlay_file))) == 1


# --- GPU, lifecycle, autoscaling ---------------------------------------------------------------

def gpu_count(container: dict, which: str) -> int:
    return int((container.get("resources", {}).get(which) or {}).get("nvidia.com/gpu", 0))


@pytest.mark.parametrize("overlay", ["base", "overlays/gpu"])
def test_gpu_engines_claim_one_gpu_each_on_gpu_nodes(overlay):
    docs = RENDERED[overlay]
    engine = find(docs, "StatefulSet", "strata-engine")
    spec = engine["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert gpu_count(container, "requests") == gpu_count(container, "limits") == 1
    assert spec["nodeSelector"] and spec["tolerations"]
    assert container["image"].endswith("-cuda")
    env = container_env(docs, container)
    assert env["STRATA_DEVICE"].startswith("cuda") and env["STRATA_MODEL"] == "/model"
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/model"]
    assert mount["readOnly"] is True
    for _, _, other, service in strata_containers(docs):
        if service != "engine":
            assert gpu_count(other, "requests") == gpu_count(other, "limits") == 0


def test_cpu_overlay_runs_engines_without_gpus_on_the_demo_model():
    docs = RENDERED["overlays/cpu"]
    for _, spec, container, service in strata_containers(docs):
        assert gpu_count(container, "requests") == gpu_count(container, "limits") == 0
        assert "nodeSelector" not in spec
        if service == "engine":
            env = container_env(docs, container)
            assert env["STRATA_DEVICE"] == "cpu" and env["STRATA_MODEL"] == ""
            assert not container["image"].endswith("-cuda")
    assert find(docs, "StatefulSet", "strata-engine")["spec"]["replicas"] == 2


def test_gateway_grace_period_covers_prestop_and_drain():
    docs = RENDERED["base"]
    deployment = find(docs, "Deployment", "strata-gateway")
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    drain_s = float(container_env(docs, container)["STRATA_DRAIN_TIMEOUT_S"])
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    pause_s = float(re.search(r"sleep\((\d+(?:\.\d+)?)\)", command[-1]).group(1))
    assert spec["terminationGracePeriodSeconds"] >= pause_s + drain_s + 5


def test_hpa_scales_the_gateway_on_the_adapters_queue_depth_metric():
    docs = RENDERED["base"]
    hpa = find(docs, "HorizontalPodAutoscaler", "strata-gateway")
    target = hpa["spec"]["scaleTargetRef"]
    find(docs, target["kind"], target["name"])
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "External"
    name = metric["external"]["metric"]["name"]
    assert metric["external"]["target"]["type"] == "AverageValue"

    values = yaml.safe_load((K8S / "monitoring" / "prometheus-adapter-values.yaml").read_text())
    (rule,) = [r for r in values["rules"]["external"] if r["name"]["as"] == name]
    series, job = re.fullmatch(r'(\w+)\{job="([\w-]+)"\}', rule["seriesQuery"]).groups()
    assert re.fullmatch(rule["name"]["matches"], series)
    # The series is the OTel gauge the gateway exports (dots -> underscores), under the gateway's
    # service.name, with the namespace label the gateway's resource attributes carry.
    otel_name = series.replace("_", ".", 2)
    sources = "\n".join(p.read_text() for p in (REPO / "services").rglob("*.py"))
    assert f'"{otel_name}"' in sources, otel_name
    assert f'"{job}"' in sources, f"no service names itself {job}"
    (label,) = rule["resources"]["overrides"]
    gateway = find(docs, "Deployment", "strata-gateway")["spec"]["template"]["spec"]
    attributes = container_env(docs, gateway["containers"][0])["OTEL_RESOURCE_ATTRIBUTES"]
    assert label.replace("_", ".") + "=" in attributes


def test_images_are_pinned():
    for overlay in ["base", *OVERLAYS]:
        for doc in RENDERED[overlay]:
            for container in (pod_spec(doc) or {}).get("containers", []) + (
                    pod_spec(doc) or {}).get("initContainers", []):
                image = container["image"]
                assert re.search(r":[\w.-]*\d[\w.-]*$", image) or "@sha256:" in image, image
                assert not image.endswith(":latest")


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_strata_pods_run_as_the_images_non_root_user(overlay):
    for _doc, spec, container, _ in strata_containers(RENDERED[overlay]):
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] == 10001
        assert container["securityContext"]["allowPrivilegeEscalation"] is False


def rendered_yaml(overlay: str) -> str:
    """What `kustomize build` would print (for a person reading a failure)."""
    return yaml.safe_dump_all(RENDERED[overlay], sort_keys=False)


def test_rendered_overlays_round_trip_as_yaml():
    for overlay in OVERLAYS:
        again: list[Any] = list(yaml.safe_load_all(rendered_yaml(overlay)))
        assert again == RENDERED[overlay]
