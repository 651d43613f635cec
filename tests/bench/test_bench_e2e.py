"""`strata bench run` / `longctx` / `dataset` against a real `strata up` cluster (small settings)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from services.bench.cli import bench_main
from services.bench.sampler import ResourceSampler
from services.models import DEFAULT_MODEL_NAME, default_model_dir

pytestmark = pytest.mark.e2e
CONFIG = json.loads((default_model_dir() / "config.json").read_text())

_spec = importlib.util.spec_from_file_location(
    "strata_e2e_cluster", Path(__file__).resolve().parents[1] / "e2e" / "conftest.py")
e2e = sys.modules.setdefault(_spec.name, importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(e2e)  # start_cluster / stop_cluster, shared with tests/e2e


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    running = e2e.start_cluster(tmp_path_factory.mktemp("bench-cluster"))
    yield running
    assert e2e.stop_cluster(running) == 0, running.output.read_text()


def run_json(argv: list[str], capsys) -> dict:
    assert bench_main([*argv, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # exactly one JSON object, progress went to stderr
    return json.loads(out)


def test_bench_run_reports_cases_quality_and_files(cluster, tmp_path, capsys):
    result = run_json(["run", "--url", cluster.base_url, "--out", str(tmp_path), "--repeat", "2",
                       "--decode-tokens", "8", "--prefill-fractions", "0.25",
                       "--sample-interval-s", "0.5"], capsys)
    assert [c["name"] for c in result["cases"]] == ["short_decode", "prefill_1_4_window"]
    short = result["cases"][0]
    assert short["num_ok"] == 2 and short["completion_tokens"] == 16
    assert short["ttft_s_p50"] > 0 and short["decode_tok_s_p50"] > 0
    assert short["prefill_tok_s_p50"] > 0 and 0 <= short["hit_rate_p50"] <= 1
    window = result["target"]["context_window"]
    assert window == CONFIG["max_position_embeddings"]
    target = window // 4 - 16  # the case's prompt leaves room for its 16 generated tokens
    assert 0.85 * target <= result["cases"][1]["prompt_tokens_p50"] <= 1.15 * target
    quality = result["quality"]
    assert quality["total"] == 12 and quality["model"] == DEFAULT_MODEL_NAME
    assert quality["passed"] == 12 and quality["agreement"] == 1.0, (
        "the serving path no longer reproduces the reference answers (if the model changed on "
        "purpose: strata bench quality)")
    assert result["total_wall_s"] > 0
    engine = result["engine"]
    total_pairs = CONFIG["num_hidden_layers"] * CONFIG["num_experts"]
    assert 0 < engine["slots"] <= engine["total_pairs"] == total_pairs and engine["pid"]
    assert result["resources"]["num_samples"] >= 2
    assert result["resources"]["engine_rss_mib_last"] > 0
    for path in [result["report"]["json"], result["report"]["markdown"],
                 *result["report"]["plots"]]:
        assert Path(path).stat().st_size > 0
    full = json.loads(Path(result["report"]["json"]).read_text())
    assert len(full["cases"][0]["requests"]) == 2


def test_longctx_over_window_is_a_clean_400_and_dataset_pairs_the_log(cluster, tmp_path,
                                                                       capsys):
    root = cluster.base_url.removesuffix("/v1") + "/"  # --url without /v1 works too
    result = run_json(["longctx", "--url", root, "--out", str(tmp_path / "l"),
                       "--fractions", "0.05", "1.0", "1.5"], capsys)
    assert [r["status"] for r in result["rungs"]] == [200, 400, 400]
    assert result["passed"] == 3 and result["serving_after"]
    data = run_json(["dataset", str(cluster.log_dir / "engine.log"), "--out",
                     str(tmp_path / "d")], capsys)
    served = cluster.engine_log().count("strata serve: prompt")
    assert data["num_requests"] == served > 0 and data["num_rejected"] == 0


def test_sweep_rounds_run_the_levels_in_turn_and_report_their_medians(cluster, tmp_path,
                                                                        capsys):
    result = run_json(["sweep", "--url", cluster.base_url, "--out", str(tmp_path),
                       "--levels", "1", "2", "--rounds", "2", "--requests-per-client", "1",
                       "--max-tokens", "4", "--sample-interval-s", "0.5"], capsys)
    rows = {(row["round"], row["concurrency"]): row for row in result["by_round"]}
    assert list(rows) == [(1, 1), (1, 2), (2, 1), (2, 2)]  # in turn, not level by level
    one, two = result["levels"]
    assert (one["rounds"], one["num_requests"], one["num_ok"]) == (2, 2, 2)
    assert (two["num_requests"], two["num_ok"], two["completion_tokens"]) == (4, 4, 16)
    assert two["aggregate_tok_s"] == pytest.approx(  # the median of two rounds: their mean
        (rows[1, 2]["aggregate_tok_s"] + rows[2, 2]["aggregate_tok_s"]) / 2)
    ratios = [rows[r, 2]["aggregate_tok_s"] / rows[r, 1]["aggregate_tok_s"] for r in (1, 2)]
    scaling = result["scaling"]["2"]
    assert scaling["over"] == 1 and scaling["per_round"] == pytest.approx(ratios)
    assert (scaling["min"], scaling["median"], scaling["max"]) == pytest.approx(
        (min(ratios), sum(ratios) / 2, max(ratios)))
    assert result["concurrency"]["2"]["aggregate_tok_s"] == two["aggregate_tok_s"]
    full = json.loads(Path(result["report"]["json"]).read_text())
    assert len(full["levels"][1]["requests"]) == 4
    assert "medians of 2 rounds" in Path(result["report"]["markdown"]).read_text()


def test_a_gateway_url_is_taken_with_or_without_v1():
    from services.bench.client import api_base

    for url in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/"):
        assert api_base(url) == "http://h:8000/v1"


def test_sampler_reads_cpu_ram_and_a_process_rss():
    import os
    import time

    with ResourceSampler(interval_s=0.05, engine_pid=os.getpid()) as sampler:
        time.sleep(0.2)
    summary = sampler.summary(tokens_generated=10)
    assert summary["num_samples"] >= 2 and summary["engine_rss_mib_last"] > 0
    assert summary["j_per_token"] is None or summary["j_per_token"] >= 0
