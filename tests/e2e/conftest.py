"""A real Strata cluster (`strata up`: embedded Redis, cachemgr, engine, gateway) for the e2e tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.common.redis_server import free_ports

ROOT = Path(__file__).resolve().parents[2]




@dataclass
class RunningCluster:
    process: subprocess.Popen[str]
    port: int
    metrics_port: int
    engine_port: int
    cachemgr_port: int
    log_dir: Path
    output: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def engine_log(self) -> str:
        return (self.log_dir / "engine.log").read_text()

    def pid(self, name: str) -> int:
        """The pid of the child `name` (redis, cachemgr, engine, gateway) started last."""
        found = re.findall(rf"strata up: {name}: (?:re)?started \(pid (\d+)" if name != "redis"
                           else r"strata up: redis: (?:embedded server at \S+ \(|restarted \()"
                           r"pid (\d+)", self.output.read_text())
        assert found, f"no pid of {name} in:\n{self.output.read_text()}"
        return int(found[-1])

    @property
    def redis_url(self) -> str:
        return re.search(r"redis: embedded server at (\S+)", self.output.read_text()).group(1)


def start_cluster(tmp: Path, *extra: str, timeout_s: float = 180.0,
                  env: dict[str, str] | None = None) -> RunningCluster:
    port, metrics_port, engine_port, cachemgr_port = free_ports(4)
    log_dir = tmp / "logs"
    output = tmp / "up.out"
    env = {**os.environ, "STRATA_HOME": str(tmp / "home"), "PYTHONUNBUFFERED": "1",
           **(env or {})}
    env.pop("STRATA_REDIS_URL", None)
    with output.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up", "--quiet", "--port", str(port),
             "--engine-port", str(engine_port), "--cachemgr-port", str(cachemgr_port),
             "--metrics-port", str(metrics_port), "--log-dir", str(log_dir), *extra],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout_s
    while "Strata is serving" not in output.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"strata up did not come up:\n{output.read_text()}")
        time.sleep(0.2)
    return RunningCluster(process, port, metrics_port, engine_port, cachemgr_port, log_dir,
                          output)


def stop_cluster(cluster: RunningCluster) -> int:
    cluster.process.send_signal(signal.SIGINT)
    try:
        return cluster.process.wait(60)
    except subprocess.TimeoutExpired:
        cluster.process.kill()
        raise


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("cluster")
    running = start_cluster(tmp, "--max-inflight", "1", "--max-queue", "2")
    yield running
    assert stop_cluster(running) == 0, running.output.read_text()


FIGURES: list[str] = []


@pytest.fixture
def figures(request: pytest.FixtureRequest):
    """`figures("time to ready: 4.1 s")`: a line for the end of the run (chaos tests' figures)."""
    def add(line: str) -> None:
        FIGURES.append(f"{request.node.name}: {line}")
    return add


def pytest_terminal_summary(terminalreporter) -> None:
    if FIGURES:
        terminalreporter.section("fault figures")
        for line in FIGURES:
            terminalreporter.write_line(line)
