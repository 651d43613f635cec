"""A trace of the engine's steps, and where a run's time went by it.

    strata up --step-trace FILE ...           (or STRATA_STEP_TRACE=FILE): one JSON line a step
    python -m services.engine.step_trace FILE [--after T]   the summary below

Each line is one step: `t` its start (seconds on the engine's perf_counter clock), `run_s` its
forward pass, `after_s` the sampling and the events after it, `rows` the sequences it served,
`tokens` the positions it computed, `prompt_tokens` those of prompts. The summary splits the
span the trace covers into the steps that only decoded (by how many rows), the steps that took
prompts, and the time between steps (the loop's own work from one step to the next, and the
engine waiting for requests): what a concurrency level loses to prompts, to partial batches and
to the requests' round trips, and how long the steps of each kind took.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO

from services.bench.stats import median, percentile


class StepTrace:
    """Appends a line per step to a file, each written as it ends (one write a step, a few
    microseconds: the file is current while the engine runs)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file: IO[str] | None = self.path.open("a", buffering=1)
        self._lock = threading.Lock()

    def record(self, start: float, run_s: float, after_s: float, rows: int, tokens: int,
               prompt_tokens: int) -> None:
        line = json.dumps({"t": round(start, 6), "run_s": round(run_s, 6),
                           "after_s": round(after_s, 6), "rows": rows, "tokens": tokens,
                           "prompt_tokens": prompt_tokens})
        with self._lock:
            if self._file is not None:
                self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read(path: str | Path) -> list[dict]:
    """The trace's steps, in order; a last line cut short (the engine still writing) skipped."""
    steps = []
    with open(path) as f:
        for line in f:
            try:
                steps.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return steps


def summarize(steps: Sequence[dict]) -> dict:
    """Where the span from the first step's start to the last one's end went."""
    if not steps:
        return {"steps": 0, "span_s": 0.0, "kinds": [], "between_s": 0.0, "between_share": 0.0}
    span = steps[-1]["t"] + steps[-1]["run_s"] + steps[-1]["after_s"] - steps[0]["t"]
    kinds: dict[int, list[dict]] = {}  # decode steps by rows, descending; prompts (-1) last
    for step in steps:
        kinds.setdefault(-1 if step["prompt_tokens"] else step["rows"], []).append(step)
    busy = sum(s["run_s"] + s["after_s"] for s in steps)
    rows = []
    for rows_, members in sorted(kinds.items(), reverse=True):
        runs = [s["run_s"] for s in members]
        total = sum(s["run_s"] + s["after_s"] for s in members)
        rows.append({"kind": "prompts" if rows_ < 0 else f"decode x{rows_}",
                     "steps": len(members), "total_s": total,
                     "share": total / span if span else 0.0,
                     "tokens": sum(s["tokens"] for s in members),
                     "run_ms_p50": 1e3 * median(runs), "run_ms_p90": 1e3 * percentile(runs, 90),
                     "run_ms_max": 1e3 * max(runs),
                     "after_ms_p50": 1e3 * median([s["after_s"] for s in members])})
    between = max(0.0, span - busy)
    return {"steps": len(steps), "span_s": span, "kinds": rows, "between_s": between,
            "between_share": between / span if span else 0.0}


def render(summary: dict) -> str:
    lines = [f"{summary['steps']} steps over {summary['span_s'] * 1e3:.1f} ms",
             "| steps | count | share of the span | tokens | forward ms p50 / p90 / max "
             "| after ms p50 |", "|---|---|---|---|---|---|"]
    for row in summary["kinds"]:
        lines.append(f"| {row['kind']} | {row['steps']} | {100 * row['share']:.1f}% "
                     f"| {row['tokens']} | {row['run_ms_p50']:.2f} / {row['run_ms_p90']:.2f} / "
                     f"{row['run_ms_max']:.2f} | {row['after_ms_p50']:.2f} |")
    lines.append(f"| between steps | | {100 * summary['between_share']:.1f}% | | | |")
    return "\n".join(lines)


def main(argv: Iterable[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", help="a file the engine wrote with --step-trace")
    p.add_argument("--after", type=float, default=None,
                   help="only the steps that start after this time (a `t` of the trace: the "
                        "last line's before a run, say)")
    a = p.parse_args(None if argv is None else list(argv))
    steps = read(a.trace)
    if a.after is not None:
        steps = [s for s in steps if s["t"] > a.after]
    if not steps:
        print(f"{a.trace}: no steps", file=sys.stderr)
        return 1
    print(render(summarize(steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
