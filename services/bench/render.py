"""What each bench's report shows: its tables and plots (see report.Report)."""

from __future__ import annotations

import matplotlib.pyplot as plt

from services.bench.report import Report, fmt, table


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _pct(share: float | None) -> str | None:
    return None if share is None else f"{share:.1%}"


def _drift(change: float | None) -> str | None:
    return None if change is None else f"{change:+.1%}"


def render_run(report: Report, r: dict) -> None:
    cases = r["cases"]
    report.section("Cases", table(
        ["case", "requests ok", "prompt tokens p50", "TTFT ms p50", "prefill tok/s p50",
         "decode tok/s p50 (engine)", "decode tok/s p50 (client)", "hit rate p50"],
        [[c["name"], f"{c['num_ok']}/{c['num_requests']}", c["prompt_tokens_p50"],
          _ms(c["ttft_s_p50"]), c["prefill_tok_s_p50"], c["decode_tok_s_p50"],
          c["client_decode_tok_s_p50"], _pct(c["hit_rate_p50"])] for c in cases]))
    q = r["quality"]
    report.section("Quality", f"{q['passed']}/{q['total']} exact-match greedy continuations"
                   + (f" (skipped: {q['skipped']})" if q.get("skipped") else
                      f" against `{q.get('file')}`, agreement {_pct(q.get('agreement'))} "
                      "(share of each expected answer reproduced before the first difference)")
                   + "\n")
    report.text(f"Total wall time: {r['total_wall_s']:.1f} s\n")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
    names = [c["name"] for c in cases]
    axes[0].bar(names, [c["decode_tok_s_p50"] or 0 for c in cases])
    axes[0].set(ylabel="decode tok/s (p50)", title="decode speed by case")
    axes[1].bar(names, [_ms(c["ttft_s_p50"]) or 0 for c in cases], color="tab:orange")
    axes[1].set(ylabel="TTFT ms (p50)", title="time to first token by case")
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=15)
    report.figure("cases", fig, "decode tok/s and TTFT per case")


def render_sweep(report: Report, r: dict) -> None:
    levels = r["levels"]
    rounds = r.get("rounds", 1)
    title = "Concurrency sweep" + (f" (medians of {rounds} rounds)" if rounds > 1 else "")
    report.section(title, table(
        ["clients", "requests ok", "aggregate tok/s", f"over {_clients(levels[0]['concurrency'])}",
         "per-request decode tok/s p50", "TTFT ms p50", "TTFT ms p95", "latency s p95"],
        [[lv["concurrency"], f"{lv['num_ok']}/{lv['num_requests']}", lv["aggregate_tok_s"],
          "1.00" if lv is levels[0] else _scaled(r.get("scaling", {}).get(
              str(lv["concurrency"])), rounds),
          lv["decode_tok_s_p50"], _ms(lv["ttft_s_p50"]), _ms(lv["ttft_s_p95"]),
          lv["latency_s_p95"]] for lv in levels]))
    c = [lv["concurrency"] for lv in levels]
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    ax.plot(c, [lv["aggregate_tok_s"] for lv in levels], "o-", label="aggregate")
    ax.plot(c, [lv["decode_tok_s_p50"] or 0 for lv in levels], "s--", label="per request p50")
    ax.set(xscale="log", xticks=c, xticklabels=c, xlabel="concurrent clients", ylabel="tok/s",
           title="throughput vs concurrency")
    ax.legend()
    report.figure("throughput", fig, "throughput vs concurrency")
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    ax.plot(c, [_ms(lv["ttft_s_p50"]) for lv in levels], "o-", label="p50")
    ax.plot(c, [_ms(lv["ttft_s_p95"]) for lv in levels], "s--", label="p95")
    ax.set(xscale="log", xticks=c, xticklabels=c, xlabel="concurrent clients", ylabel="TTFT ms",
           title="TTFT vs concurrency")
    ax.legend()
    report.figure("ttft", fig, "TTFT vs concurrency")


def _clients(n: int) -> str:
    return f"{n} client" + ("s" if n != 1 else "")


def _scaled(scaling: dict | None, rounds: int) -> str:
    """A level's aggregate over the first level's: the rounds' median (and range)."""
    if scaling is None or scaling["median"] is None:  # a result from before --rounds
        return "-"
    spread = f" ({scaling['min']:.2f}-{scaling['max']:.2f})" if rounds > 1 else ""
    return f"{scaling['median']:.2f}{spread}"


def render_soak(report: Report, r: dict) -> None:
    drift = r.get("memory", {})
    report.section("Soak", table(["figure", "value"], [
        ["duration s / concurrency", f"{r['duration_s']:.0f} / {r['concurrency']}"],
        ["requests ok / failed", f"{r['num_success']} / {r['num_failed']}"],
        ["TTFT ms p50, first half", _ms(r["ttft_s_p50_first_half"])],
        ["TTFT ms p50, second half", _ms(r["ttft_s_p50_second_half"])],
        ["TTFT drift (wall clock)", _drift(r["ttft_drift"])],
        ["inter-token ms p50, first / second half",
         f"{fmt(_ms(r.get('itl_s_p50_first_half')))} / "
         f"{fmt(_ms(r.get('itl_s_p50_second_half')))}"],
        ["TTFT drift at the host's pace", _drift(r.get("ttft_drift_at_host_pace"))],
        ["engine RSS MiB start -> end", f"{fmt(drift.get('engine_rss_mib_start'))} -> "
                                        f"{fmt(drift.get('engine_rss_mib_end'))}"],
        ["engine RSS drift MiB", drift.get("engine_rss_drift_mib")]], 2))
    if verdict := r.get("verdict"):
        report.section(f"Verdict: {'pass' if verdict['ok'] else 'FAIL'}", table(
            ["criterion", "value", "limit", "pass", "how"],
            [[name, c["value"] if not isinstance(c["value"], float) else f"{c['value']:+.2%}",
              c["limit"] if not isinstance(c["limit"], float) else f"{c['limit']:.0%}",
              "yes" if c["ok"] else "NO", c.get("note", "")]
             for name, c in verdict["criteria"].items()]))
    ok = [q for q in r["requests"] if q["ok"]]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot([q["start_s"] for q in ok], [_ms(q["ttft_s"]) for q in ok], ".")
    ax.set(xlabel="request start (s)", ylabel="TTFT ms", title="TTFT over the soak")
    report.figure("ttft", fig, "TTFT over the soak")
    rss = [(s["t_s"], s["engine_rss_mib"]) for s in r.get("samples", []) if "engine_rss_mib" in s]
    if len(rss) >= 2:
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.plot(*zip(*rss, strict=True), "-")
        ax.set(xlabel="time (s)", ylabel="engine RSS MiB", title="Engine memory over the soak")
        report.figure("rss", fig, "Engine memory over the soak")


def render_overload(report: Report, r: dict) -> None:
    report.section("Overload burst", table(["figure", "value"], [
        ["simultaneous requests", r["num_requests"]],
        ["accepted / rejected", f"{r['num_accepted']} / {r['num_rejected']}"],
        ["by status", ", ".join(f"{k}: {v}" for k, v in r["by_status"].items())],
        ["accepted latency s p50 / max", f"{fmt(r['accepted_latency_s_p50'], 2)} / "
                                         f"{fmt(r['accepted_latency_s_max'], 2)}"],
        ["rejected latency ms p50 / p99 / max", f"{fmt(_ms(r['rejected_latency_s_p50']))} / "
                                                f"{fmt(_ms(r['rejected_latency_s_p99']))} / "
                                                f"{fmt(_ms(r['rejected_latency_s_max']))}"],
        ["Retry-After s", ", ".join(fmt(v, 0) for v in r["retry_after_s"]) or "-"],
        [f"/livez during the burst ms p50 / p99 ({r['livez_probes']} probes)",
         f"{fmt(_ms(r['livez_latency_s_p50']))} / {fmt(_ms(r['livez_latency_s_p99']))}"],
        [f"{r['num_requests']} x /livez at once ms p50 / p99 (the floor)",
         f"{fmt(_ms(r['livez_burst_latency_s_p50']))} / "
         f"{fmt(_ms(r['livez_burst_latency_s_p99']))}"],
        ["rejected p99 / the floor's p99", fmt(r["rejected_over_livez_burst_p99"], 2)]], 2))
    report.text(table(["#", "status", "reason", "latency s", "TTFT s"],
                      [[i, q["status"], q["drop_reason"] or q["error_code"] or "",
                        q["latency_s"], q["ttft_s"]] for i, q in enumerate(r["requests"])], 3))
    fig, ax = plt.subplots(figsize=(6, 3.2))
    qs = sorted(r["requests"], key=lambda q: q["latency_s"])
    ax.bar(range(len(qs)), [q["latency_s"] for q in qs],
           color=["tab:green" if q["ok"] else "tab:red" for q in qs])
    ax.set(xlabel="request (sorted)", ylabel="latency s",
           title="overload: accepted (green) vs rejected (red)")
    report.figure("latency", fig, "latency of each request")


def render_longctx(report: Report, r: dict) -> None:
    report.section("Long-context ladder", table(
        ["x window", "prompt tokens", "expected", "status", "code", "TTFT ms", "prefill tok/s",
         "pass"],
        [[f"{g['fraction']:g}", g["prompt_tokens"], g["expected"], g["status"], g["error_code"],
          _ms(g["ttft_s"]) if g["ok"] else None, g["prefill_tok_s"], g["passed"]]
         for g in r["rungs"]]) + f"\n\n{r['passed']}/{r['total']} rungs as expected; serving "
        f"afterwards: {fmt(r['serving_after'])}\n")
    ok = [g for g in r["rungs"] if g["ok"]]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot([g["prompt_tokens"] for g in ok], [_ms(g["ttft_s"]) for g in ok], "o-")
    ax.axvline(r["context_window"], color="tab:red", linestyle=":", label="context window")
    ax.set(xlabel="prompt tokens", ylabel="TTFT ms", title="TTFT vs prompt length")
    ax.legend()
    report.figure("ttft", fig, "TTFT vs prompt length")


def render_dataset(report: Report, r: dict) -> None:
    report.section("Pairing", f"{r['num_requests']} requests paired ({r['num_with_decode']} "
                   f"with decode steps), {r['num_rejected']} lines rejected "
                   f"{r['rejected_by_reason'] or ''}; Pearson r (hit rate vs decode tok/s) = "
                   f"{fmt(r['pearson_r_hit_rate_decode'], 3)}, (spill vs decode) = "
                   f"{fmt(r['pearson_r_spill_decode'], 3)}\n")
    for key, title in (("by_spill_ratio", "By spill ratio"), ("by_hit_rate", "By hit rate")):
        report.section(title, table(["bucket", "requests", "decode tok/s p50", "share of best"],
                                    [[b["bucket"], b["count"], b["decode_p50_tok_s"],
                                      b["share_of_best"]] for b in r[key]], 2))
    records = [x for x in r["records"] if x["lookups"] > 0 and x["decode_tok_s"] > 0]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.scatter([x["hit_rate"] for x in records], [x["decode_tok_s"] for x in records], s=8)
    ax.set(xlabel="decode expert cache hit rate", ylabel="decode tok/s",
           title="hit rate vs decode speed")
    report.figure("scatter", fig, "hit rate vs decode tok/s")
    buckets = r["by_spill_ratio"]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar([b["bucket"] for b in buckets], [b["decode_p50_tok_s"] or 0 for b in buckets])
    ax.set(xlabel="spill (share of routed served outside the cache)",
           ylabel="decode tok/s p50", title="decode speed by spill bucket")
    report.figure("spill", fig, "decode p50 by spill bucket")
