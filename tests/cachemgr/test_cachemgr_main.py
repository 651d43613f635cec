"""Settings, and `python -m services.cachemgr` as a real process (start, health, SIGTERM)."""

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.cachemgr.config import SETTINGS, CacheMgrConfig
from services.common.pb.strata.v1 import cachemgr_pb2, cachemgr_pb2_grpc
from services.common.profile import Profile
from services.common.redis_server import free_port
from services.common.settings import ConfigError, add_settings, resolve

ROOT = Path(__file__).resolve().parents[2]
MiB = 2**20


def parse(argv, environ):
    parser = argparse.ArgumentParser()
    add_settings(parser, SETTINGS)
    return CacheMgrConfig.from_values(resolve(SETTINGS, parser.parse_args(argv), environ))


def test_defaults_flags_and_env(monkeypatch, tmp_path):
    monkeypatch.setenv("STRATA_HOME", str(tmp_path))
    config = parse([], {})
    assert config == CacheMgrConfig(profile_path=tmp_path / "cachemgr" / "expert-profile.bin")
    assert (config.address, config.metrics_port, config.reserve_bytes) == (
        "127.0.0.1:50061", 9464, 700 * MiB)
    assert config.redis_url is None and config.device_memory_bytes is None
    assert (config.profile_save_interval_s, config.profile_half_life_s, config.replan_drift,
            config.replan_settle_s, config.sample_interval_s) == (60, 600, 0.02, 10, 2)
    config = parse(["--data-dir", "/srv/cm", "--replan-drift", "5%"],
                   {"STRATA_PROFILE_HALF_LIFE": "120", "STRATA_REPLAN_SETTLE": "0"})
    assert config.profile_path == Path("/srv/cm/expert-profile.bin")
    assert (config.replan_drift, config.profile_half_life_s, config.replan_settle_s) == (
        0.05, 120, 0)
    config = parse(["--port", "7000", "--reserve", "1GiB", "--profile", "/tmp/p.bin"],
                   {"STRATA_REDIS_URL": "redis://h:6379/0", "STRATA_DEVICE_MEMORY": "8GiB",
                    "STRATA_METRICS_PORT": "0", "STRATA_CACHEMGR_PORT": "1"})
    assert (config.port, config.reserve_bytes, config.profile_path) == (7000, 2**30,
                                                                        Path("/tmp/p.bin"))
    assert (config.redis_url, config.device_memory_bytes, config.metrics_port) == (
        "redis://h:6379/0", 8 * 2**30, 0)


@pytest.mark.parametrize("environ, named", [
    ({"STRATA_CACHEMGR_PORT": "70000"}, "STRATA_CACHEMGR_PORT"),
    ({"STRATA_REDIS_URL": "localhost:6379"}, "STRATA_REDIS_URL"),
    ({"STRATA_RESERVE": "lots"}, "STRATA_RESERVE"),
    ({"STRATA_REPLAN_DRIFT": "150%"}, "STRATA_REPLAN_DRIFT"),
    ({"STRATA_PROFILE_HALF_LIFE": "0"}, "STRATA_PROFILE_HALF_LIFE"),
    ({"STRATA_PROFILE_SAVE_INTERVAL": "-1"}, "STRATA_PROFILE_SAVE_INTERVAL"),
])
def test_bad_values_name_the_variable(environ, named):
    with pytest.raises(ConfigError, match=named):
        parse([], environ)


def start_process(tmp_path, *args):
    env = os.environ | {"PYTHONPATH": str(ROOT), "STRATA_REDIS_URL": "",
                        "STRATA_HOME": str(tmp_path / "home")}
    return subprocess.Popen([sys.executable, "-m", "services.cachemgr", *args], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_process_serves_from_a_profile_and_stops_on_sigterm(tmp_path):
    counts = np.zeros((2, 4), dtype=np.int64)  # [L, E]
    counts[1, 3], counts[0, 2] = 9, 4
    Profile.from_counts(counts, "cafef00d").write(tmp_path / "expert-profile.bin")
    port = free_port()
    process = start_process(tmp_path, "--port", str(port), "--metrics-port", "0",
                            "--profile", str(tmp_path / "expert-profile.bin"),
                            "--device-memory", "3MiB", "--reserve", "1MiB")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=15)
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            plan = cachemgr_pb2_grpc.CacheManagerStub(channel).GetPlan(
                cachemgr_pb2.GetPlanRequest(engine_id="e", model=cachemgr_pb2.ModelShape(
                    fingerprint="cafef00d", num_layers=2, num_experts=4, slot_bytes=MiB)))
            assert plan.source == "profile"
            assert [(p.layer, p.expert) for p in plan.pairs] == [(1, 3), (0, 2)]
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=15)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, output
    assert "expert profile" in output and "stopped" in output
    assert "2 slots" in output  # the sizing line


def test_corrupt_profile_stops_start_with_a_clear_line(tmp_path):
    (tmp_path / "bad.bin").write_bytes(b"garbage")
    process = start_process(tmp_path, "--port", "0", "--metrics-port", "0",
                            "--profile", str(tmp_path / "bad.bin"))
    output, _ = process.communicate(timeout=30)  # it exits by itself
    assert process.returncode == 2, output
    assert "cannot start" in output and "truncated header" in output
    assert "Traceback" not in output
