"""Planner accuracy on this machine: fit at two device-memory budgets, predict a third, measure it.

    python -m services.bench.accuracy --out docs/bench [--skip-samples | --samples-only]
                                                              (~12 min on 2 CPU cores)

1. warm-up cluster, recording its routing (the engine's --record-routing): phase A, short
   decodes like the measurement's (other prompts); its routing counts (all and decode-only, from
   the cache manager's Redis) become expert-profile.bin, the starting ranking of every budget.
   Phase B, more short decodes (other prompts again): their part of the trace becomes
   accuracy-routing.trace.gz, a workload the profile was not built from, like the measurement's
2. one `strata up --device-memory B` cluster per budget (default: the least whole MiB giving
   6.25%, 20% and 70% of the model's pairs, from the warm-up engine's slot size), all up at
   once; short decodes sent
   round-robin (same prompt to each budget per round), so CPU noise from other work hits all
   budgets alike -> accuracy-B.json (the shape `strata plan fit` reads), with the engine's decode
   lookups and hits over the measured rounds (the aggregate hit rate)
3. the sample reports at the largest budget: bench run, sweep, soak, overload, longctx, dataset
   (not with --skip-samples)
4. each budget held out in turn: fit on the other two, predict its hit rate (the trace replayed
   through the cache policy at its slot count; the profile's decode CDF; measured points) and
   decode tok/s, compare with what was measured there -> accuracy.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import io
import json
import math
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import numpy as np

from services.bench import planner
from services.bench.cli import bench_main
from services.bench.client import Gateway, discover
from services.bench.fit import fit_results
from services.bench.planner import CostModel, Hardware, HitRateModel
from services.bench.report import Report, machine, table
from services.bench.stats import median_interval, percentile
from services.bench.suites import open_context, stderr_progress, summarize
from services.common.profile import Profile
from services.engine.cache.trace import Trace

WARMUP_A_SEED, WARMUP_B_SEED, MEASURE_SEED = 1000, 2000, 100  # disjoint prompt sets

ROOT = Path(__file__).resolve().parents[2]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def cluster(work: Path, budget: str | None, env_extra: dict[str, str]) -> Iterator[dict]:
    """`strata up` as a child process; yields its gateway URL, log dir and Redis URL."""
    work.mkdir(parents=True, exist_ok=True)
    out_path, port = work / "up.out", _port()
    args = ["--device-memory", budget] if budget else []
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **env_extra}
    env.pop("STRATA_REDIS_URL", None)
    with out_path.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up", "--quiet", "--port", str(port),
             "--engine-port", str(_port()), "--cachemgr-port", str(_port()),
             "--metrics-port", str(_port()), "--log-dir", str(work / "logs"), *args],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while "Strata is serving" not in out_path.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"strata up failed:\n{out_path.read_text()}")
            time.sleep(0.3)
        redis = re.search(r"embedded server at (\S+)", out_path.read_text())
        yield {"url": f"http://127.0.0.1:{port}/v1", "logs": work / "logs",
               "redis": redis[1] if redis else None}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def bench(*argv: str) -> dict:
    """One bench in this process; returns its full result JSON."""
    say(f"strata bench {' '.join(argv)}")
    with contextlib.redirect_stdout(io.StringIO()) as captured:
        code = bench_main([*argv, "--json"])
    if code != 0:
        raise RuntimeError(f"bench {argv[0]} failed ({code})")
    return json.loads(Path(json.loads(captured.getvalue())["report"]["json"]).read_text())


def routing_profile(redis_url: str, num_layers: int, num_experts: int) -> Profile:
    """The routing counts so far (all tokens, and decode tokens alone) from the cache
    manager's Redis hashes, as a profile."""
    import redis

    from services.cachemgr.store import DECODE, KEY_PREFIX, routing_key

    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(KEY_PREFIX + "*"))
    assert len(keys) == 1, f"expected one model's routing counts, found {keys}"
    fingerprint = keys[0].decode()[len(KEY_PREFIX):]

    def table(key: str | bytes) -> np.ndarray:
        counts = np.zeros((num_layers, num_experts), dtype=np.int64)  # [L, E]
        for field, value in client.hgetall(key).items():
            layer, expert = (int(x) for x in field.decode().split(":"))
            counts[layer, expert] = int(value)
        return counts

    decode = table(routing_key(fingerprint, DECODE))
    client.close()
    return Profile.from_counts(table(keys[0]), fingerprint,
                               decode_counts=decode if decode.any() else None)


def say(message: str) -> None:
    print(f"accuracy: {message}", file=sys.stderr, flush=True)


def measured(result: dict) -> dict:
    """A budget's measured figures. `hit_rate` is the aggregate over the measured rounds (the
    engine's decode hits / lookups), what a replay predicts; `hit_rate_p50` the median request."""
    case = next(c for c in result["cases"] if c["name"] == "short_decode")
    e = result["engine"]
    speeds = [q["decode_tok_s"] for q in case["requests"] if q["ok"] and q["decode_tok_s"]]
    counters = result.get("decode_counters") or {}
    aggregate = (counters["hits"] / counters["lookups"] if counters.get("lookups")
                 else case["hit_rate_p50"])
    work = (planner.cache_work(counters["lookups"], counters["hits"], counters["demand_fills"],
                               counters["prefetch_fills"]) if "demand_fills" in counters else None)
    return {"budget_mib": e["device_memory_bytes"] / 2**20, "slots": e["slots"],
            "coverage": e["coverage"], "hit_rate": aggregate,
            "hit_rate_p50": case["hit_rate_p50"], "decode_lookups": counters.get("lookups"),
            "cache_work": None if work is None else asdict(work),
            "decode_tok_s": case["decode_tok_s_p50"], "decode_tok_s_ci95": median_interval(speeds),
            "decode_tok_s_p25": percentile(speeds, 25),
            "decode_tok_s_p75": percentile(speeds, 75), "plan_source": e["plan_source"],
            "plan_version": e.get("plan_version"), "requests": case["num_ok"]}


def replay_model(profile: Profile, trace: Trace) -> HitRateModel:
    """The phase-B trace replayed through the recorded cache policy, pre-filled from the profile
    as every budget's engine was."""
    fill = profile.top_pairs(len(profile.ranked))
    return planner.trace_hit_rate(trace, fill, label="accuracy-routing.trace.gz")


def hit_models(fit: dict, profile: Profile, replayed: HitRateModel | None
               ) -> dict[str, HitRateModel]:
    """The planner's hit-rate sources, most faithful first: the trace replayed, the profile's
    decode CDF, and the fit budgets' measured points."""
    models = {"replayed": replayed} if replayed is not None else {}
    models["profile"] = planner.profile_hit_rate(profile)
    models["measured"] = planner.measured_hit_rate([tuple(p) for p in fit["hit_points"]],
                                                   fit["hardware"]["total_pairs"])
    return models


def predict(fit: dict, profile: Profile, replayed: HitRateModel | None, held_out: dict) -> dict:
    hw_fit = fit["hardware"]
    hw = Hardware(hw_fit["slot_bytes"], hw_fit["total_pairs"], hw_fit["reserved_bytes"],
                  weight_bytes=hw_fit.get("weight_bytes") or 0,
                  kv_bytes=hw_fit.get("kv_bytes") or 0)
    cost = CostModel.from_dict(fit["cost_model"])
    free = round(held_out["budget_mib"] * 2**20)
    out = {}
    for name, hits in hit_models(fit, profile, replayed).items():
        row = planner.plan_row(hw, free, hits, cost)
        out[name] = {**row, "cache_work": asdict(hits.work(row["slots"])) if hits.work else None,
                     "hit_rate_error_points": 100 * (row["hit_rate"] - held_out["hit_rate"]),
                     "decode_rel_error": row["decode_tok_s"] / held_out["decode_tok_s"] - 1}
    return out


async def interleaved(urls: dict[str, str], rounds: int, max_tokens: int) -> dict[str, dict]:
    """Short decodes sent round-robin to every budget's gateway, the same prompt to each in a
    round (greedy: the same tokens), so a noisy shared CPU slows every budget alike."""
    async with contextlib.AsyncExitStack() as stack:
        ctxs = {}
        for budget, url in urls.items():
            gateway = await stack.enter_async_context(Gateway(url))
            ctxs[budget] = await open_context(gateway, None, stderr_progress(f"accuracy {budget}"))
        outcomes: dict[str, list] = {b: [] for b in urls}
        start: dict[str, dict] = {}
        order = list(urls)
        for i in range(rounds + 1):  # round 0 warms every engine up and is dropped
            for budget in order:
                ctx = ctxs[budget]
                outcome = await ctx.gateway.complete(ctx.prompts.make(32, seed=MEASURE_SEED + i),
                                                     max_tokens)
                if i:
                    outcomes[budget].append(outcome)
            if i == 0:  # the engines' decode counters from here on cover the measured rounds
                start = {b: await discover(c.gateway) for b, c in ctxs.items()}
            order = order[1:] + order[:1]  # rotate: no budget always goes first
            say(f"round {i}/{rounds}: " + ", ".join(
                f"{b} {o[-1].decode_tok_s or 0:.0f} tok/s" for b, o in outcomes.items() if o))
        results = {}
        for budget, ctx in ctxs.items():
            engine = await discover(ctx.gateway)
            results[budget] = {
                "bench": "run", "protocol": "interleaved short decodes", "rounds": rounds,
                "engine": engine, "target": ctx.describe(),
                "decode_counters": {k: engine.get(k, 0) - start[budget].get(k, 0) for k in
                                    ("lookups", "hits", "demand_fills", "prefetch_fills")},
                "cases": [{"name": "short_decode", **summarize(outcomes[budget]),
                           "requests": [o.to_dict() for o in outcomes[budget]]}]}
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.bench.accuracy")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench")
    p.add_argument("--work", type=Path, default=Path("/tmp/strata-accuracy"))
    p.add_argument("--budgets", nargs=3, help="device-memory budgets, e.g. 706MiB 720MiB 768MiB "
                   "(default: the least whole MiB giving --coverages of the model's pairs)")
    p.add_argument("--coverages", type=float, nargs=3, default=[0.0625, 0.2, 0.7])
    p.add_argument("--sample-budget", help="where the other benches run (default: the largest)")
    p.add_argument("--skip-samples", action="store_true",
                   help="only the planner accuracy: no bench run/sweep/soak/overload/longctx")
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--warmup-requests", type=int, default=48,
                   help="short decodes in each warm-up phase (A: profile, B: routing trace)")
    p.add_argument("--soak-s", type=float, default=120.0)
    p.add_argument("--reuse", action="store_true", help="no new clusters: recompute the "
                   "accuracy from OUT/accuracy-BUDGET.json and OUT/expert-profile.bin")
    p.add_argument("--samples-only", action="store_true", help="only step 3, on one cluster at "
                   "--sample-budget (default: the largest saved accuracy budget) starting from "
                   "OUT/expert-profile.bin; the accuracy files stay as they are")
    a = p.parse_args(argv)
    out, work = a.out, a.work
    out.mkdir(parents=True, exist_ok=True)
    profile_path, trace_path = out / "expert-profile.bin", out / "accuracy-routing.trace.gz"
    if a.samples_only:
        budget = a.sample_budget or max(
            (p.stem.removeprefix("accuracy-") for p in out.glob("accuracy-*MiB.json")),
            key=lambda b: float(b.removesuffix("MiB")))
        own = work / "samples" / "expert-profile.bin"
        own.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(profile_path, own)
        env = {"STRATA_HOME": str(work / "home"), "STRATA_PROFILE": str(own)}
        with cluster(work / "samples", budget, env) as c:
            say(f"sample benches at {budget}")
            sample_benches(c, out, a.soak_s)
        return 0
    if not a.reuse:
        engine = warm_up(work, profile_path, trace_path, a.warmup_requests)
        a.budgets = a.budgets or budgets_for(engine, a.coverages)
        measure(a, work, profile_path)
    a.budgets = a.budgets or sorted(
        (p.stem.removeprefix("accuracy-") for p in out.glob("accuracy-*MiB.json")),
        key=lambda b: float(b.removesuffix("MiB")))
    paths = {b: out / f"accuracy-{b}.json" for b in a.budgets}
    trace = planner.read_trace(trace_path) if trace_path.is_file() else None
    write_accuracy(out, paths, Profile.read(profile_path), trace)
    return 0


def budgets_for(engine: dict, coverages: list[float]) -> list[str]:
    """The least whole MiB of device memory that buys each coverage of the model's pairs, by
    the budget rule with the engine's own terms."""
    slot_bytes, pairs = engine["slot_bytes"], engine["total_pairs"]
    overhead = (engine["reserved_bytes"] + engine.get("weight_bytes", 0)
                + engine.get("kv_bytes", 0) + engine.get("draft_bytes", 0))
    return [f"{math.ceil((overhead + math.ceil(c * pairs) * slot_bytes) / 2**20)}MiB"
            for c in coverages]


async def short_decodes(url: str, num_requests: int, seed: int, max_tokens: int = 128) -> dict:
    """The measurement's kind of request (32-token prompt, 128 generated), other prompts;
    returns what the engine said of itself."""
    async with Gateway(url) as gateway:
        ctx = await open_context(gateway, None, stderr_progress("accuracy warm-up"))
        for i in range(num_requests):
            outcome = await gateway.complete(ctx.prompts.make(32, seed=seed + i), max_tokens)
            if not outcome.ok:
                raise RuntimeError(f"warm-up request failed: {outcome.error_message}")
        return ctx.engine


def warm_up(work: Path, profile_path: Path, trace_path: Path, num_requests: int) -> dict:
    """Phase A's routing counts -> the profile of every budget; phase B's routing -> the trace
    the planner replays (see the module docstring). Returns the warm-up engine's status."""
    recorded = work / "warmup" / "routing.trace"
    recorded.parent.mkdir(parents=True, exist_ok=True)
    env = {"STRATA_HOME": str(work / "home"), "STRATA_PROFILE": str(work / "warmup" / "live.bin"),
           "STRATA_RECORD_ROUTING": str(recorded)}
    with cluster(work / "warmup", None, env) as c:
        say(f"warm-up A: {num_requests} short decodes -> the profile")
        engine = asyncio.run(short_decodes(c["url"], num_requests, WARMUP_A_SEED))
        time.sleep(5)  # the engine reports routing counts every 2 s (and flushes its trace)
        trace_a = Trace.read(recorded)
        routing_profile(c["redis"], trace_a.num_layers, trace_a.num_experts).write(profile_path)
        phase_b_offset = recorded.stat().st_size
        say(f"warm-up B: {num_requests} short decodes -> the routing trace")
        asyncio.run(short_decodes(c["url"], num_requests, WARMUP_B_SEED))
        time.sleep(1)
    data = recorded.read_bytes()
    _, _, meta_len = struct.unpack_from("<8sII", data)  # trace.py's header: magic, version, len
    header_end = struct.calcsize("<8sII") + meta_len
    with open(trace_path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        f.write(data[:header_end] + data[phase_b_offset:])  # header + phase B
    say(f"profile {profile_path} ({len(trace_a.records)} records of phase A); trace "
        f"{trace_path} ({len(planner.read_trace(trace_path).records)} records of phase B)")
    return engine


def measure(a: argparse.Namespace, work: Path, profile_path: Path) -> None:
    out = a.out
    with contextlib.ExitStack() as stack:
        clusters = {}
        for budget in a.budgets:
            own = work / budget / "expert-profile.bin"  # the live profile overwrites its copy
            own.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(profile_path, own)
            env = {"STRATA_HOME": str(work / "home"), "STRATA_PROFILE": str(own)}
            clusters[budget] = stack.enter_context(cluster(work / budget, budget, env))
        results = asyncio.run(interleaved({b: c["url"] for b, c in clusters.items()},
                                          a.rounds, 128))
        for budget, result in results.items():
            result.update(command="python -m services.bench.accuracy", machine=machine())
            (out / f"accuracy-{budget}.json").write_text(json.dumps(result, indent=1) + "\n")
        if not a.skip_samples:
            sample_benches(clusters[a.sample_budget or a.budgets[-1]], out, a.soak_s)


def sample_benches(c: dict, out: Path, soak_s: float) -> None:
    url = ["--url", c["url"]]
    bench("run", *url, "--out", str(out / "run"))
    bench("sweep", *url, "--out", str(out / "sweep"))
    bench("soak", *url, "--duration-s", str(soak_s), "--concurrency", "2",
          "--out", str(out / "soak"))
    bench("overload", *url, "--requests", "32", "--out", str(out / "overload"))
    bench("longctx", *url, "--out", str(out / "longctx"))
    bench("dataset", str(c["logs"] / "engine.log"), "--out", str(out / "dataset"))


def write_accuracy(out: Path, paths: dict[str, Path], profile: Profile,
                   trace: Trace | None) -> None:
    budgets = list(paths)
    results = {b: json.loads(p.read_text()) for b, p in paths.items()}
    rows = {b: measured(results[b]) for b in budgets}
    replayed = replay_model(profile, trace) if trace is not None else None
    checks = []
    for held in budgets:
        fit_on = [b for b in budgets if b != held]
        fit = fit_results([paths[b] for b in fit_on])
        checks.append({"fit_on": fit_on, "held_out": held, "measured": rows[held],
                       "cost_model": fit["cost_model"], "fit_error": fit["error"],
                       "predicted": predict(fit, profile, replayed, rows[held])})
    result = {"machine": machine(), "budgets": rows, "checks": checks,
              "profile": "expert-profile.bin", "profile_pairs": len(profile.ranked),
              "profile_has_decode_counts": profile.decode_counts is not None,
              "trace": "accuracy-routing.trace.gz" if trace else None,
              "trace_records": len(trace.records) if trace else None}
    report = Report(out, "accuracy", "Planner accuracy: fit at two budgets, predict a third")
    report.section("Measured (interleaved short decodes)", table(
        ["budget", "slots", "coverage", "plan (version)", "requests", "hit rate (all decode)",
         "hit rate p50", "misses / fills per lookup", "decode tok/s p50 (95% CI)",
         "decode p25-p75"],
        [[b, r["slots"], f"{r['coverage']:.1%}", f"{r['plan_source']} (v{r['plan_version']})",
          r["requests"], f"{r['hit_rate']:.1%}", f"{r['hit_rate_p50']:.1%}",
          "-" if r["cache_work"] is None else
          f"{r['cache_work']['misses']:.3f} / {r['cache_work']['fills']:.3f}",
          f"{r['decode_tok_s']:.1f} ({r['decode_tok_s_ci95'][0]:.0f}-{r['decode_tok_s_ci95'][1]:.0f})",
          f"{r['decode_tok_s_p25']:.0f}-{r['decode_tok_s_p75']:.0f}"] for b, r in rows.items()]))
    lines = []
    for ch in checks:
        m = ch["measured"]
        for source, pr in ch["predicted"].items():
            lines.append([", ".join(ch["fit_on"]), ch["held_out"], source,
                          f"{pr['hit_rate']:.1%} vs {m['hit_rate']:.1%}",
                          f"{pr['hit_rate_error_points']:+.1f}",
                          f"{pr['decode_tok_s']:.1f} vs {m['decode_tok_s']:.1f}",
                          f"{100 * pr['decode_rel_error']:+.1f}%", pr["basis"]["hit_rate"],
                          f"{pr['basis']['decode_tok_s']} ({pr['basis']['decode_model']}, "
                          f"{pr['basis']['decode_driver']})"])
    report.section("Predicted vs measured at the held-out budget", table(
        ["fit on", "held out", "hit-rate source", "hit rate (pred vs meas)", "error (points)",
         "decode tok/s (pred vs meas)", "error", "hit-rate basis", "decode basis (model, driver)"],
        lines))
    report.text("Cache work = misses and slot fills (on demand and by prefetch) per decode "
                "lookup: the engine's counters over the measured rounds, or the replay's at a "
                "predicted size. The cost model is fitted on the fills for an engine on the CPU "
                "(a miss is read in place at the speed of a hit), on misses + fills behind a "
                "link; either needs the replay to predict (the decode driver says which drove "
                "each prediction).")
    report.section("Cost models", "\n".join(
        f"- fit on {', '.join(ch['fit_on'])}: {ch['cost_model']['basis']}; in-sample RMS "
        f"error {ch['fit_error']['rms_rel_error']:.1%}" for ch in checks))
    _plot(report, rows, checks, profile, replayed)
    result["report"] = report.write(result)
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, default=str))


def _plot(report: Report, rows: dict, checks: list[dict], profile: Profile,
          replayed: HitRateModel | None) -> None:
    import matplotlib.pyplot as plt

    total = profile.total_pairs
    slots = np.arange(total + 1)
    cdf = planner.profile_hit_rate(profile)
    hits, grid = cdf, slots.tolist()  # the curve the decode predictions follow
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    if replayed is not None:  # a replay per point: a coarse grid through the measured sizes
        hits, grid = replayed, sorted({*np.linspace(0, total, 11).round().astype(int).tolist(),
                                       *(r["slots"] for r in rows.values())})
        axes[0].plot([s / total for s in grid], [replayed.hit_rate(s) for s in grid],
                     label="trace replayed")
    axes[0].plot(slots / total, [cdf.hit_rate(int(s)) for s in slots], label="profile CDF")
    axes[0].plot([0, 1], [0, 1], ":", color="grey", label="uniform routing")
    axes[0].plot([r["coverage"] for r in rows.values()], [r["hit_rate"] for r in rows.values()],
                 "o", label="measured")
    axes[0].set(xlabel="coverage", ylabel="hit rate", title="hit rate vs coverage")
    axes[0].legend()
    for check in checks:
        cost = CostModel.from_dict(check["cost_model"])
        axes[1].plot([s / total for s in grid], [cost.decode_tok_s(hits.hit_rate(s), hits.work(s) if hits.work else None)
                                         for s in grid],
                     label=f"fit on {', '.join(check['fit_on'])} ({cost.form})")
    axes[1].plot([r["coverage"] for r in rows.values()],
                 [r["decode_tok_s"] for r in rows.values()], "o", label="measured")
    axes[1].set(xlabel="coverage", ylabel="decode tok/s (p50)", title="decode vs coverage",
                ylim=(0, None))
    axes[1].legend()
    report.figure("curves", fig, "planner curves and measured points")


if __name__ == "__main__":
    sys.exit(main())
