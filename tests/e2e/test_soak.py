"""The soak in CI: `strata bench soak --check` for 60 s at 4 clients against `strata up` on the
default model, with the criteria of the 10-minute run (docs/bench/soak/): no failed request,
TTFT drift < 5% between the halves, engine RSS drift < 1%, every KV block free at the end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.conftest import ROOT, start_cluster, stop_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_a_60_s_soak_at_4_clients_meets_every_criterion(tmp_path, figures):
    c = start_cluster(tmp_path, "--max-inflight", "4", "--max-queue", "4")
    try:
        run = subprocess.run(
            [sys.executable, "-m", "services.cli", "bench", "soak", "--url", c.base_url,
             "--duration-s", "60", "--concurrency", "4", "--check", "--json",
             "--out", str(tmp_path / "soak")],
            cwd=ROOT, capture_output=True, text=True, timeout=240)
    finally:
        assert stop_cluster(c) == 0, c.output.read_text()[-3000:]
    assert run.stdout, run.stderr[-3000:]
    result = json.loads(run.stdout)
    checks = result["verdict"]["criteria"]
    figures(", ".join(f"{name} {check['value']:.4g}" if isinstance(check["value"], float)
                      else f"{name} {check['value']}" for name, check in checks.items())
            + f" over {result['num_requests']} requests")
    assert result["num_requests"] >= 60 and result["num_success"] == result["num_requests"]
    assert result["memory"]["engine_rss_mib_start"] > 0  # the engine's memory was sampled
    assert result["verdict"]["ok"] and run.returncode == 0, (checks, run.stderr[-2000:])
