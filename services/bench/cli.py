"""`strata bench ...` and `strata plan ...`: flags -> the benches / planner -> report files.

Entry points for services/cli.py: `bench_main(argv)` and `plan_main(argv)`, each returns an exit
code. With `--json` exactly one JSON object goes to stdout; progress always goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from services.bench import load, render, suites
from services.bench.client import Gateway, discover
from services.bench.dataset import HIT_EDGES, SPILL_EDGES, pair_lines, summarize
from services.bench.report import Report, header, machine, resources_section
from services.bench.sampler import ResourceSampler
from services.common.settings import positive_int

BENCHES = ("run", "sweep", "soak", "overload", "longctx", "dataset")
_BULKY = ("requests", "records", "samples", "rejected", "points", "checks")


def strata_home() -> Path:
    # Same rule as services.engine.model.demo.strata_home, without importing torch.
    return Path(os.environ.get("STRATA_HOME") or Path.home() / ".cache" / "strata")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="strata bench", description="Benchmarks against a running "
                                "gateway, and the telemetry dataset from engine logs.")
    sub = p.add_subparsers(dest="bench", required=True)
    live = argparse.ArgumentParser(add_help=False)
    live.add_argument("--url", default=os.environ.get("STRATA_BENCH_URL",
                                                      "http://127.0.0.1:8000/v1"),
                      help="gateway base URL, with or without /v1 [env STRATA_BENCH_URL]")
    live.add_argument("--model", help="model id (default: the gateway's first)")
    live.add_argument("--api-key", default=os.environ.get("STRATA_BENCH_API_KEY"))
    live.add_argument("--context-window", type=int,
                      help="tokens (default: the engine's status, else probed)")
    live.add_argument("--engine-pid", type=int, help="engine process for RSS (default: found "
                      "from the engine's port when it runs here)")
    live.add_argument("--sample-interval-s", type=float, default=2.0)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", type=Path, help="report directory (default: "
                        "$STRATA_HOME/bench/NAME-TIMESTAMP)")
    common.add_argument("--json", action="store_true", help="print one JSON object")
    both = [live, common]
    run = sub.add_parser("run", parents=both, help="short decode, long prefill, quality checks")
    run.add_argument("--decode-tokens", type=int, default=128)
    run.add_argument("--repeat", type=int, default=3, help="short-decode requests")
    run.add_argument("--prefill-fractions", type=float, nargs="+", default=[1 / 8, 1 / 2])
    run.add_argument("--quality-file", type=Path, help="recorded answers (default: "
                     "services/bench/quality/MODEL.json; record with `strata bench quality`)")
    run.add_argument("--skip-quality", action="store_true")
    sweep = sub.add_parser("sweep", parents=both, help="concurrency sweep")
    sweep.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    sweep.add_argument("--requests-per-client", type=int, default=2)
    sweep.add_argument("--max-tokens", type=int, default=64)
    sweep.add_argument("--rounds", type=positive_int, default=1,
                       help="run the levels in turn this many times and report each level's "
                            "median (a drifting host hits all alike)")
    soak = sub.add_parser("soak", parents=both, help="steady load for a while")
    soak.add_argument("--duration-s", type=float, default=600.0)
    soak.add_argument("--concurrency", type=int, default=1)
    soak.add_argument("--max-tokens", type=int, default=64,
                      help="the mean completion length; each request asks for 0.5-1.5x it")
    soak.add_argument("--check", action="store_true", help="exit 1 unless every criterion "
                      "holds: no failed request, TTFT drift < 5%%, engine RSS drift < 1%%, "
                      "every KV block free at the end")
    over = sub.add_parser("overload", parents=both, help="N simultaneous requests")
    over.add_argument("--requests", type=int, default=32)
    over.add_argument("--max-tokens", type=int, default=32)
    lctx = sub.add_parser("longctx", parents=both, help="prompt-length ladder past the window")
    lctx.add_argument("--fractions", type=float, nargs="+", default=list(load.LADDER))
    data = sub.add_parser("dataset", parents=[common], help="pair engine log lines")
    data.add_argument("logs", nargs="+", type=Path)
    data.add_argument("--spill-edges", type=float, nargs="+", default=list(SPILL_EDGES))
    data.add_argument("--hit-edges", type=float, nargs="+", default=list(HIT_EDGES))
    return p


async def _bench(args: argparse.Namespace) -> dict:
    progress = suites.stderr_progress(f"strata bench {args.bench}")
    async with Gateway(args.url, args.model, args.api_key) as gateway:
        ctx = await suites.open_context(gateway, args.context_window, progress)
        with ResourceSampler(args.sample_interval_s, args.engine_pid or ctx.engine.get("pid")
                             ) as sampler:
            result = await _dispatch(ctx, args)
        engine_after = await discover(gateway)
    result.update(target=ctx.describe(), engine=ctx.engine, engine_after=engine_after,
                  resources=sampler.summary(_tokens(result)), samples=sampler.samples)
    if args.bench == "soak":
        result["memory"] = load.memory_drift(sampler.samples)
        address = ctx.engine.get("address")
        end = await load.engine_idle(address) if address else None
        result["engine_at_end"] = end
        result["verdict"] = load.soak_verdict(result, result["memory"], end)
    return result


async def _dispatch(ctx: suites.BenchContext, a: argparse.Namespace) -> dict:
    if a.bench == "run":
        return await suites.bench_run(
            ctx, decode_tokens=a.decode_tokens, repeat=a.repeat,
            prefill_fractions=a.prefill_fractions, quality_file=a.quality_file,
            skip_quality=a.skip_quality)
    if a.bench == "sweep":
        return await load.bench_sweep(ctx, levels=a.levels,
                                      requests_per_client=a.requests_per_client,
                                      max_tokens=a.max_tokens, rounds=a.rounds)
    if a.bench == "soak":
        return await load.bench_soak(ctx, duration_s=a.duration_s, concurrency=a.concurrency,
                                     max_tokens=a.max_tokens)
    if a.bench == "overload":
        return await load.bench_overload(ctx, num_requests=a.requests, max_tokens=a.max_tokens)
    return await load.bench_longctx(ctx, fractions=a.fractions)


def _tokens(node: Any) -> int:
    """Completion tokens of every successful request anywhere in a result."""
    if isinstance(node, dict):
        if "requests" in node:
            return sum(q.get("completion_tokens") or 0 for q in node["requests"] if q.get("ok"))
        return sum(_tokens(v) for v in node.values() if isinstance(v, dict | list))
    if isinstance(node, list):
        return sum(_tokens(v) for v in node)
    return 0


def compact(node: Any) -> Any:
    """The result without its per-request/per-sample lists (those stay in the JSON file)."""
    if isinstance(node, dict):
        return {k: compact(v) for k, v in node.items() if k not in _BULKY}
    if isinstance(node, list):
        return [compact(v) for v in node]
    return node


_RENDER = {"run": render.render_run, "sweep": render.render_sweep, "soak": render.render_soak,
           "overload": render.render_overload, "longctx": render.render_longctx,
           "dataset": render.render_dataset}


def bench_main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    started = time.time()
    if args.bench == "dataset":
        pairing = None
        for path in args.logs:
            with open(path, errors="replace") as f:
                part = pair_lines(f, str(path))
            if pairing is None:
                pairing = part
            else:
                pairing.records += part.records
                pairing.rejected += part.rejected
        assert pairing is not None
        result = {"bench": "dataset", "logs": [str(p) for p in args.logs],
                  **summarize(pairing, args.spill_edges, args.hit_edges)}
    else:
        try:
            result = asyncio.run(_bench(args))
        except (RuntimeError, OSError) as exc:
            print(f"strata bench {args.bench}: {exc}", file=sys.stderr)
            return 1
    result["command"] = "strata bench " + shlex.join(argv)
    result["machine"] = machine()
    result["started_at"] = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started))
    out = args.out or strata_home() / "bench" / f"{args.bench}-{time.strftime('%Y%m%d-%H%M%S')}"
    report = Report(out, args.bench, f"strata bench {args.bench}")
    header(report, result)
    _RENDER[args.bench](report, result)
    resources_section(report, result.get("samples", []), result.get("resources", {}))
    result["report"] = report.write(result)
    if args.json:
        print(json.dumps(compact(result), default=str))
    else:
        print(Path(result["report"]["markdown"]).read_text())
        print(f"report: {result['report']['markdown']} (JSON: {result['report']['json']})")
    verdict = result.get("verdict")
    if getattr(args, "check", False) and verdict and not verdict["ok"]:
        failed = [f"{name} = {c['value']} (limit {c['limit']})"
                  for name, c in verdict["criteria"].items() if not c["ok"]]
        print(f"strata bench {args.bench}: failed: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0
