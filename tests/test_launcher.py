"""`strata up`'s supervision of its children: real child processes, a clock the test moves."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from services.launcher import Child, Cluster, LaunchError, RestartPolicy, Supervised, UpConfig

SLEEPER = "import sys, time; print('child up', flush=True); time.sleep(120)"
CRASHER = "print('boom: the model file is corrupt', flush=True); raise SystemExit(3)"


def cluster(tmp_path: Path, policy: RestartPolicy) -> Cluster:
    config = UpConfig(model=None, device_memory=None, max_inflight=None, max_queue=None, port=0,
                      engine_port=1, cachemgr_port=1, metrics_port=1, log_dir=tmp_path,
                      ready_timeout_s=30.0, echo=False)
    return Cluster(config, policy)


def started(tmp_path: Path, code: str, c: Cluster) -> Supervised:
    child = Child("engine", [sys.executable, "-c", code], lambda: True, tmp_path / "engine.log")
    child.start(dict(os.environ), echo=False)
    supervised = Supervised(child, c.policy)
    c.children.append(supervised)
    return supervised


def wait_up(child: Child) -> None:
    deadline = time.monotonic() + 30
    while "child up" not in child.tail:
        assert time.monotonic() < deadline, "the child did not start"
        time.sleep(0.01)


def wait_dead(child: Child) -> None:
    deadline = time.monotonic() + 30
    while child.exit_code() is None:
        assert time.monotonic() < deadline, "the child did not die"
        time.sleep(0.01)


def test_backoff_doubles_up_to_its_cap():
    policy = RestartPolicy(first_backoff_s=1.0, max_backoff_s=5.0)
    assert [policy.backoff_s(n) for n in (1, 2, 3, 4, 5)] == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_a_killed_child_is_restarted_after_the_backoff_and_the_others_untouched(
        tmp_path, capsys):
    c = cluster(tmp_path, RestartPolicy(max_deaths=3, window_s=60, first_backoff_s=2.0))
    engine = started(tmp_path, SLEEPER, c)
    other = started(tmp_path, SLEEPER, c)
    first_pid, other_pid = engine.child.pid, other.child.pid
    try:
        wait_up(engine.child)
        os.kill(first_pid, signal.SIGKILL)
        wait_dead(engine.child)
        c.tend(engine, now=100.0)
        assert engine.state == Supervised.WAITING
        c.tend(engine, now=101.9)  # still inside the backoff
        assert engine.state == Supervised.WAITING and engine.child.exit_code() == -9
        c.tend(engine, now=102.0)
        assert engine.state == Supervised.STARTING and engine.child.pid != first_pid
        c.tend(engine, now=102.5)
        assert engine.state == Supervised.RUNNING and engine.restarts == 1
        c.tend(other, now=102.5)
        assert other.child.pid == other_pid and other.child.exit_code() is None
        wait_up(engine.child)  # the restarted child has written its first line (a slow host)
    finally:
        c.stop()
    out = capsys.readouterr().out
    assert "engine was killed by SIGKILL; its last log lines" in out
    assert "child up" in out and "restarting in 2 s (death 1 of 3 allowed within 60 s)" in out
    assert "engine: ready again in 0.5 s after restart 1" in out
    assert (tmp_path / "engine.log").read_text().count("child up") == 2


def test_a_crash_loop_stops_the_cluster_with_the_reason_and_its_last_lines(tmp_path):
    c = cluster(tmp_path, RestartPolicy(max_deaths=3, window_s=60, first_backoff_s=1.0))
    engine = started(tmp_path, CRASHER, c)
    now = 0.0
    with pytest.raises(LaunchError) as caught:
        for _ in range(10):
            wait_dead(engine.child)
            c.tend(engine, now)  # a death: waiting for its backoff
            now += RestartPolicy().max_backoff_s
            c.tend(engine, now)  # started again
    message = str(caught.value)
    assert engine.restarts == 2 and len(engine.deaths) == 3
    assert "engine died 3 times within 60 s (crash loop; limit 3, --max-deaths)" in message
    assert "exited with code 3" in message and "boom: the model file is corrupt" in message


def test_deaths_older_than_the_window_do_not_count(tmp_path):
    c = cluster(tmp_path, RestartPolicy(max_deaths=2, window_s=10, first_backoff_s=1.0))
    engine = started(tmp_path, CRASHER, c)
    try:
        for now in (0.0, 20.0, 40.0, 60.0):  # each death alone within its 10 s window
            wait_dead(engine.child)
            c.tend(engine, now)
            assert engine.state == Supervised.WAITING and len(engine.deaths) == 1
            c.tend(engine, now + 1.0)
        assert engine.restarts == 4
    finally:
        c.stop()


def test_a_restart_that_never_gets_ready_is_killed_and_counted(tmp_path, capsys):
    c = cluster(tmp_path, RestartPolicy(max_deaths=5, window_s=600, first_backoff_s=1.0))
    engine = started(tmp_path, SLEEPER, c)
    engine.child.ready = lambda: False  # e.g. a model load that hangs
    try:
        os.kill(engine.child.pid, signal.SIGKILL)
        wait_dead(engine.child)
        c.tend(engine, 0.0)
        c.tend(engine, 1.0)
        assert engine.state == Supervised.STARTING
        c.tend(engine, 1.0 + c.config.ready_timeout_s + 0.1)
        wait_dead(engine.child)
        c.tend(engine, 40.0)
        assert engine.state == Supervised.WAITING and len(engine.deaths) == 2
    finally:
        c.stop()
    assert "not ready 30 s after its restart; killing it" in capsys.readouterr().out
