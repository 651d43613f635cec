"""Planner accuracy on this machine: fit at two device-memory budgets, predict a third, measure it.

    python -m services.bench.accuracy --out docs/bench      (about 6 minutes on 2 CPU cores)

1. warm-up cluster: short decodes; the cache manager's live profile (or, failing that, its
   Redis routing counts) becomes expert-profile.bin, the starting ranking of every budget
2. one `strata up --device-memory B` cluster per budget, all up at once; short decodes sent
   round-robin (same prompt to each budget per round), so CPU noise from other work hits all
   budgets alike -> accuracy-B.json (the shape `strata plan fit` reads)
3. the sample reports at one budget: bench run, sweep, soak, overload, longctx, dataset
4. each budget held out in turn: fit on the other two, predict its hit rate (profile CDF and
   measured points) and decode tok/s, compare with its measured medians -> accuracy.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from services.bench import planner
from services.bench.cli import bench_main
from services.bench.client import Gateway, discover
from services.bench.fit import fit_results
from services.bench.planner import CostModel, Hardware
from services.bench.report import Report, machine, table
from services.bench.stats import percentile
from services.bench.suites import open_context, stderr_progress, summarize
from services.common.profile import Profile

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


def routing_profile(redis_url: str) -> Profile:
    """The warm-up's routing counts from the cache manager's Redis hash, as a profile."""
    import redis

    from services.cachemgr.store import KEY_PREFIX

    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(KEY_PREFIX + "*"))
    assert len(keys) == 1, f"expected one model's routing counts, found {keys}"
    fields = client.hgetall(keys[0])
    pairs = {tuple(int(x) for x in k.decode().split(":")): int(v) for k, v in fields.items()}
    num_layers = max(layer for layer, _ in pairs) + 1
    num_experts = max(expert for _, expert in pairs) + 1
    counts = np.zeros((num_layers, num_experts), dtype=np.int64)  # [L, E]
    for (layer, expert), count in pairs.items():
        counts[layer, expert] = count
    return Profile.from_counts(counts, keys[0].decode()[len(KEY_PREFIX):])


def say(message: str) -> None:
    print(f"accuracy: {message}", file=sys.stderr, flush=True)


def measured(result: dict) -> dict:
    case = next(c for c in result["cases"] if c["name"] == "short_decode")
    e = result["engine"]
    speeds = [q["decode_tok_s"] for q in case["requests"] if q["ok"] and q["decode_tok_s"]]
    return {"budget_mib": e["device_memory_bytes"] / 2**20, "slots": e["slots"],
            "coverage": e["coverage"], "hit_rate": case["hit_rate_p50"],
            "decode_tok_s": case["decode_tok_s_p50"], "decode_tok_s_p25": percentile(speeds, 25),
            "decode_tok_s_p75": percentile(speeds, 75), "plan_source": e["plan_source"],
            "requests": case["num_ok"]}


def predict(fit: dict, profile: Profile, held_out: dict) -> dict:
    hw_fit = fit["hardware"]
    hw = Hardware(hw_fit["slot_bytes"], hw_fit["total_pairs"], hw_fit["reserved_bytes"])
    cost = CostModel.from_dict(fit["cost_model"])
    free = round(held_out["budget_mib"] * 2**20)
    out = {}
    for name, hits in (("profile", planner.profile_hit_rate(profile)),
                       ("measured", planner.measured_hit_rate(
                           [tuple(p) for p in fit["hit_points"]], hw.total_pairs))):
        row = planner.plan_row(hw, free, hits, cost)
        out[name] = {**row, "hit_rate_error_points": 100 * (row["hit_rate"] - held_out["hit_rate"]),
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
        order = list(urls)
        for i in range(rounds + 1):  # round 0 warms every engine up and is dropped
            for budget in order:
                ctx = ctxs[budget]
                outcome = await ctx.gateway.complete(ctx.prompts.make(32, seed=100 + i),
                                                     max_tokens)
                if i:
                    outcomes[budget].append(outcome)
            order = order[1:] + order[:1]  # rotate: no budget always goes first
            say(f"round {i}/{rounds}: " + ", ".join(
                f"{b} {o[-1].decode_tok_s or 0:.0f} tok/s" for b, o in outcomes.items() if o))
        results = {}
        for budget, ctx in ctxs.items():
            results[budget] = {
                "bench": "run", "protocol": "interleaved short decodes", "rounds": rounds,
                "engine": await discover(ctx.gateway), "target": ctx.describe(),
                "cases": [{"name": "short_decode", **summarize(outcomes[budget]),
                           "requests": [o.to_dict() for o in outcomes[budget]]}]}
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.bench.accuracy")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench")
    p.add_argument("--work", type=Path, default=Path("/tmp/strata-accuracy"))
    p.add_argument("--budgets", nargs=3, default=["706MiB", "720MiB", "768MiB"])
    p.add_argument("--sample-budget", default="768MiB", help="where the other benches run")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--soak-s", type=float, default=120.0)
    p.add_argument("--reuse", action="store_true", help="no new clusters: recompute the "
                   "accuracy from OUT/accuracy-BUDGET.json and OUT/expert-profile.bin")
    a = p.parse_args(argv)
    out, work = a.out, a.work
    out.mkdir(parents=True, exist_ok=True)
    profile_path = out / "expert-profile.bin"
    if not a.reuse:
        warm_up_profile(work, profile_path)
        measure(a, work, profile_path)
    paths = {b: out / f"accuracy-{b}.json" for b in a.budgets}
    write_accuracy(out, paths, Profile.read(profile_path))
    return 0


def warm_up_profile(work: Path, profile_path: Path) -> None:
    """Short decodes on a default cluster; the cache manager's live profile (saved at its
    shutdown to STRATA_PROFILE) becomes the profile of every budget."""
    live = work / "warmup" / "expert-profile.bin"
    env = {"STRATA_HOME": str(work / "home"), "STRATA_PROFILE": str(live)}
    with cluster(work / "warmup", None, env) as c:
        bench("sweep", "--url", c["url"], "--levels", "1", "--requests-per-client", "12",
              "--max-tokens", "128", "--out", str(work / "warmup" / "sweep"))
        time.sleep(5)  # the engine reports routing counts every 2 s
        snapshot = routing_profile(c["redis"])
    if live.is_file():
        shutil.copyfile(live, profile_path)
    else:  # a cache manager that keeps no live profile: its Redis counts
        snapshot.write(profile_path)


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
        sample_benches(clusters[a.sample_budget], out, a.soak_s)


def sample_benches(c: dict, out: Path, soak_s: float) -> None:
    url = ["--url", c["url"]]
    bench("run", *url, "--out", str(out / "run"))
    bench("sweep", *url, "--out", str(out / "sweep"))
    bench("soak", *url, "--duration-s", str(soak_s), "--concurrency", "2",
          "--out", str(out / "soak"))
    bench("overload", *url, "--requests", "32", "--out", str(out / "overload"))
    bench("longctx", *url, "--out", str(out / "longctx"))
    bench("dataset", str(c["logs"] / "engine.log"), "--out", str(out / "dataset"))


def write_accuracy(out: Path, paths: dict[str, Path], profile: Profile) -> None:
    budgets = list(paths)
    results = {b: json.loads(p.read_text()) for b, p in paths.items()}
    rows = {b: measured(results[b]) for b in budgets}
    checks = []
    for held in budgets:
        fit_on = [b for b in budgets if b != held]
        fit = fit_results([paths[b] for b in fit_on])
        checks.append({"fit_on": fit_on, "held_out": held, "measured": rows[held],
                       "cost_model": fit["cost_model"], "fit_error": fit["error"],
                       "predicted": predict(fit, profile, rows[held])})
    result = {"machine": machine(), "budgets": rows, "checks": checks,
              "profile": "expert-profile.bin", "profile_pairs": len(profile.ranked)}
    report = Report(out, "accuracy", "Planner accuracy: fit at two budgets, predict a third")
    report.section("Measured (interleaved short decodes, p50)", table(
        ["budget", "slots", "coverage", "plan", "requests", "hit rate", "decode tok/s",
         "decode p25-p75"],
        [[b, r["slots"], f"{r['coverage']:.1%}", r["plan_source"], r["requests"],
          f"{r['hit_rate']:.1%}", r["decode_tok_s"],
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
                          pr["basis"]["decode_tok_s"]])
    report.section("Predicted vs measured at the held-out budget", table(
        ["fit on", "held out", "hit-rate source", "hit rate (pred vs meas)", "error (points)",
         "decode tok/s (pred vs meas)", "error", "hit-rate basis", "decode basis"], lines))
    _plot(report, rows, checks, profile)
    result["report"] = report.write(result)
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, default=str))


def _plot(report: Report, rows: dict, checks: list[dict], profile: Profile) -> None:
    import matplotlib.pyplot as plt

    total = profile.total_pairs
    slots = np.arange(total + 1)
    cdf = planner.profile_hit_rate(profile)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    axes[0].plot(slots / total, [cdf.hit_rate(int(s)) for s in slots], label="profile CDF")
    axes[0].plot([0, 1], [0, 1], ":", color="grey", label="uniform routing")
    axes[0].plot([r["coverage"] for r in rows.values()], [r["hit_rate"] for r in rows.values()],
                 "o", label="measured")
    axes[0].set(xlabel="coverage", ylabel="hit rate", title="hit rate vs coverage")
    axes[0].legend()
    for check in checks:
        cost = CostModel.from_dict(check["cost_model"])
        axes[1].plot(slots / total, [cost.decode_tok_s(cdf.hit_rate(int(s))) for s in slots],
                     label=f"fit on {', '.join(check['fit_on'])}")
    axes[1].plot([r["coverage"] for r in rows.values()],
                 [r["decode_tok_s"] for r in rows.values()], "o", label="measured")
    axes[1].set(xlabel="coverage", ylabel="decode tok/s (p50)", title="decode vs coverage",
                ylim=(0, None))
    axes[1].legend()
    report.figure("curves", fig, "planner curves and measured points")


if __name__ == "__main__":
    sys.exit(main())
