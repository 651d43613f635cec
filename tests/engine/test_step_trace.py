"""--step-trace: a line per engine step, and the summary of where a run's time went."""

from __future__ import annotations

import json
import subprocess
import sys

from services.engine.core import Engine
from services.engine.step_trace import StepTrace, read, render, summarize
from tests.engine.test_batching import PROMPTS, make_runner, request, run_all


def test_an_engine_writes_one_line_per_step_with_its_rows_and_prompt_tokens(tiny_dir, tmp_path):
    path = tmp_path / "steps.jsonl"
    engine = Engine(make_runner(tiny_dir), max_running=4, max_step_tokens=64,
                    step_trace=StepTrace(path))
    engine.start()
    try:
        clients = run_all(engine, [request(PROMPTS[1], max_tokens=6, ignore_eos=True),
                                   request(PROMPTS[4], max_tokens=6, ignore_eos=True)])
    finally:
        engine.stop()  # closes the trace: every line is on disk
    steps = read(path)
    assert len(steps) == engine.steps
    prompts = sum(len(engine.runner.tokenizer.encode(p)) for p in (PROMPTS[1], PROMPTS[4]))
    assert sum(s["prompt_tokens"] for s in steps) == prompts
    # every generated token but each request's first (sampled after its prompt) is a decode
    # position, and every step's tokens are its prompt tokens plus one per decoding row
    decoded = sum(len(c.tokens) - 1 for c in clients)
    assert sum(s["tokens"] - s["prompt_tokens"] for s in steps) == decoded
    assert all(s["rows"] >= 1 and s["run_s"] > 0 and s["after_s"] >= 0 for s in steps)
    assert [s["t"] for s in steps] == sorted(s["t"] for s in steps)


def test_the_summary_splits_the_span_into_step_kinds_and_the_time_between_steps(tmp_path):
    steps = [  # a prompt alone, two decode steps of 2 rows, 6 ms of waiting, one of 1 row
        {"t": 0.000, "run_s": 0.004, "after_s": 0.001, "rows": 1, "tokens": 30,
         "prompt_tokens": 30},
        {"t": 0.005, "run_s": 0.002, "after_s": 0.0005, "rows": 2, "tokens": 2,
         "prompt_tokens": 0},
        {"t": 0.0075, "run_s": 0.002, "after_s": 0.0005, "rows": 2, "tokens": 2,
         "prompt_tokens": 0},
        {"t": 0.016, "run_s": 0.001, "after_s": 0.0, "rows": 1, "tokens": 1,
         "prompt_tokens": 0},
    ]
    summary = summarize(steps)
    assert abs(summary["span_s"] - 0.017) < 1e-9
    assert abs(summary["between_s"] - 0.006) < 1e-9
    kinds = {k["kind"]: k for k in summary["kinds"]}
    assert [k["kind"] for k in summary["kinds"]] == ["decode x2", "decode x1", "prompts"]
    assert kinds["decode x2"]["steps"] == 2 and abs(kinds["decode x2"]["total_s"] - 0.005) < 1e-9
    assert kinds["prompts"]["tokens"] == 30 and abs(kinds["prompts"]["share"] - 5 / 17) < 1e-9
    assert "| between steps | | 35.3% |" in render(summary)
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in steps) + "{\"t\": 0.0")
    done = subprocess.run([sys.executable, "-m", "services.engine.step_trace", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "4 steps over 17.0 ms" in done.stdout and "| decode x2 | 2 | 29.4% |" in done.stdout


def test_an_unwritable_trace_file_stops_the_engine_before_it_loads_with_the_reason(tmp_path):
    done = subprocess.run([sys.executable, "-m", "services.engine", "--port", "0",
                           "--step-trace", str(tmp_path / "missing" / "steps.jsonl")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--step-trace" in done.stderr and "No such file or directory" in done.stderr
    assert "Traceback" not in done.stderr
