"""Load benches: concurrency sweep, soak, overload burst, long-context ladder."""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Sequence

from services.bench.burst import burst, http_get, http_request
from services.bench.client import Gateway, Outcome, engine_status
from services.bench.stats import median, percentile
from services.bench.suites import BenchContext, summarize


async def _worker(ctx: BenchContext, prompt_tokens: int, max_tokens: int, seed: int,
                  count: int | None, deadline: float | None,
                  vary_lengths: bool = False) -> list[Outcome]:
    """Closed loop: `count` requests back to back, or until `deadline` (perf_counter).
    `vary_lengths`: each request asks for between half and 1.5x `max_tokens` (seeded), so
    that clients do not fall into step with each other (arriving together, prefilling in one
    step) and the load stays the same from start to end."""
    rng = random.Random(seed)
    outcomes: list[Outcome] = []
    i = 0
    while (count is None or i < count) and (deadline is None or time.perf_counter() < deadline):
        prompt = ctx.prompts.make(prompt_tokens, seed=seed * 10_000 + i)
        length = rng.randint(max(1, max_tokens // 2), max_tokens * 3 // 2) if vary_lengths \
            else max_tokens
        outcomes.append(await ctx.gateway.complete(prompt, length))
        i += 1
    return outcomes


async def bench_sweep(ctx: BenchContext, *, levels: Sequence[int] = (1, 2, 4, 8, 16),
                      requests_per_client: int = 2, prompt_tokens: int = 32,
                      max_tokens: int = 64, rounds: int = 1) -> dict:
    """Each level: as many clients, each sending `requests_per_client` requests back to back.
    With rounds > 1 the levels run in turn that many times (1, 2, 4, ..., 1, 2, 4, ...), so
    that a drift in the host's speed hits every level alike; a level then reports the median
    of its rounds, and `scaling` each level's aggregate over the first level's in the same
    round (median, min, max)."""
    levels = list(dict.fromkeys(levels))  # a level named twice runs once a round
    rows = []
    address = ctx.engine.get("address")
    for r in range(rounds):
        for level in levels:
            before = await asyncio.to_thread(engine_status, address) if address else None
            t0 = time.perf_counter()
            per_client = await asyncio.gather(*(  # new prompts each round: no prefix reuse
                _worker(ctx, prompt_tokens, max_tokens, r * 100_000 + level * 100 + c,
                        requests_per_client, None)
                for c in range(level)))
            wall_s = time.perf_counter() - t0
            outcomes = [o for client in per_client for o in client]
            summary = summarize(outcomes)
            after = await asyncio.to_thread(engine_status, address) if address else None
            row = {"concurrency": level, "round": r + 1, "wall_s": wall_s, **summary,
                   "aggregate_tok_s": summary["completion_tokens"] / wall_s if wall_s else None,
                   "distinct_pairs_per_layer_step": _distinct_per_layer_step(before, after),
                   "requests": [o.to_dict() for o in outcomes]}
            rows.append(row)
            ctx.progress(f"{f'round {r + 1}/{rounds}, ' if rounds > 1 else ''}concurrency "
                         f"{level}: {summary['num_ok']}/{len(outcomes)} ok, aggregate "
                         f"{row['aggregate_tok_s']:.1f} tok/s, TTFT p50 "
                         f"{_ms(summary['ttft_s_p50'])} p95 {_ms(summary['ttft_s_p95'])}")
    by_level = {level: [row for row in rows if row["concurrency"] == level] for level in levels}
    merged = [_merge_rounds(level_rows) for level_rows in by_level.values()]
    result = {"bench": "sweep", "requests_per_client": requests_per_client,
              "prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "rounds": rounds,
              "levels": merged,
              "scaling": {str(level): _scaling(by_level[level], by_level[levels[0]])
                          for level in levels[1:]},
              "concurrency": {str(lv["concurrency"]): {
                  "aggregate_tok_s": lv["aggregate_tok_s"],
                  "per_client_tok_s": lv["client_decode_tok_s_p50"],
                  "ttft_p50_s": lv["ttft_s_p50"], "ttft_p95_s": lv["ttft_s_p95"],
                  "hit_rate": lv["hit_rate_p50"],
                  "distinct_pairs_per_layer_step": lv["distinct_pairs_per_layer_step"]}
                  for lv in merged}}
    if rounds > 1:
        result["by_round"] = [{k: v for k, v in row.items() if k != "requests"} for row in rows]
    return result


_SUMMED = frozenset({"wall_s", "num_requests", "num_ok", "num_failed", "completion_tokens"})


def _merge_rounds(rows: list[dict]) -> dict:
    """One level's rounds as one row: counts summed, every other figure the rounds' median,
    every request kept."""
    merged: dict = {"concurrency": rows[0]["concurrency"], "rounds": len(rows)}
    for key in rows[0]:
        if key in ("concurrency", "round", "requests"):
            continue
        values = [row[key] for row in rows if row[key] is not None]
        merged[key] = sum(values) if key in _SUMMED else median(values)
    merged["requests"] = [request for row in rows for request in row["requests"]]
    return merged


def _scaling(rows: list[dict], base: list[dict]) -> dict:
    """A level's aggregate over the base level's, round by round."""
    ratios = [row["aggregate_tok_s"] / b["aggregate_tok_s"] for row, b in zip(rows, base,
                                                                               strict=True)
              if row["aggregate_tok_s"] and b["aggregate_tok_s"]]
    return {"over": base[0]["concurrency"], "median": median(ratios),
            "min": min(ratios, default=None), "max": max(ratios, default=None),
            "per_round": ratios}


def _distinct_per_layer_step(before: dict | None, after: dict | None) -> float | None:
    """Distinct pairs the engine looked up per MoE layer per step during one level: how much
    of a step's routing the batch shares (one lookup serves every token routed to a pair)."""
    if not before or not after:
        return None
    steps = after["layer_steps"] - before["layer_steps"]
    return (after["distinct_pairs_routed"] - before["distinct_pairs_routed"]) / steps \
        if steps else None


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f} ms"


# What a soak must show (issue #22): no failed request, first-token latency steady between
# the halves, engine memory steady, and every KV block free once the load stops.
SOAK_LIMITS = {"failures": 0, "ttft_drift": 0.05, "engine_rss_drift": 0.01}


async def bench_soak(ctx: BenchContext, *, duration_s: float, concurrency: int = 1,
                     prompt_tokens: int = 32, max_tokens: int = 64) -> dict:
    t0 = time.perf_counter()
    deadline = t0 + duration_s

    async def report() -> None:
        while time.perf_counter() < deadline:
            await asyncio.sleep(min(30.0, max(1.0, duration_s / 10)))
            ctx.progress(f"soak: {time.perf_counter() - t0:.0f}/{duration_s:.0f} s")

    reporter = asyncio.create_task(report())
    per_client = await asyncio.gather(*(
        _worker(ctx, prompt_tokens, max_tokens, 500 + c, None, deadline, vary_lengths=True)
        for c in range(concurrency)))
    reporter.cancel()
    outcomes = sorted((o for client in per_client for o in client), key=lambda o: o.start_s)
    half = (t0 - ctx.gateway.origin) + duration_s / 2
    halves = ([o for o in outcomes if o.ok and o.start_s < half],
              [o for o in outcomes if o.ok and o.start_s >= half])
    p50_first, p50_second = (median([o.ttft_s for o in h]) for h in halves)
    drift = p50_second / p50_first - 1.0 if p50_first and p50_second else None
    # The host's own speed drifts (shared memory bandwidth): the same halves' decode pace
    # says by how much, and TTFT per inter-token time is what is left of the server's drift.
    pace = [median([1.0 / o.client_decode_tok_s for o in h if o.client_decode_tok_s])
            for h in halves]
    paced = (p50_second / pace[1]) / (p50_first / pace[0]) - 1.0 \
        if p50_first and p50_second and all(pace) else None
    interval = ttft_drift_interval(*halves, at_host_pace=False)
    paced_interval = ttft_drift_interval(*halves, at_host_pace=True)
    ctx.progress(f"soak: {sum(o.ok for o in outcomes)}/{len(outcomes)} ok, TTFT drift "
                 f"{_pct(drift)} (95% interval {_pct(interval[0])} .. {_pct(interval[1])}), "
                 f"{_pct(paced)} at the host's pace ({_pct(paced_interval[0])} .. "
                 f"{_pct(paced_interval[1])})")
    return {"bench": "soak", "duration_s": duration_s, "concurrency": concurrency,
            "wall_s": time.perf_counter() - t0, **summarize(outcomes),
            "num_success": sum(o.ok for o in outcomes),
            "ttft_s_p50_first_half": p50_first, "ttft_s_p50_second_half": p50_second,
            "itl_s_p50_first_half": pace[0], "itl_s_p50_second_half": pace[1],
            "ttft_drift": drift, "ttft_drift_95": interval,
            "ttft_drift_at_host_pace": paced, "ttft_drift_at_host_pace_95": paced_interval,
            "requests": [o.to_dict() for o in outcomes]}


def ttft_drift_interval(first: Sequence[Outcome], second: Sequence[Outcome], *,
                        at_host_pace: bool, resamples: int = 2000, seed: int = 0,
                        blocks: int = 6) -> tuple[float | None, ...]:
    """A 95% bootstrap interval of the TTFT p50 drift between the halves, on the wall clock or
    `at_host_pace` (each half's TTFT per its inter-token p50): how well the run pins the drift
    down (a minute of requests: about +-5%). Requests close in time share the host's state
    (its neighbours' load moves within seconds, and dividing by the half's pace takes out only
    what moves TTFT and decode alike), so each half is resampled as runs of consecutive
    requests, `blocks` runs' worth (a moving-block bootstrap), not request by request: a half
    whose requests came in slow and fast spells gets the wider interval that it warrants."""
    import numpy as np

    halves = [np.array([(o.ttft_s, 1.0 / o.client_decode_tok_s if at_host_pace else 1.0)
                        for o in h if o.ttft_s and o.client_decode_tok_s])
              for h in (first, second)]
    if any(len(h) < 10 for h in halves):
        return (None, None)
    rng = np.random.default_rng(seed)
    paced = []
    for h in halves:  # in start order
        n = len(h)
        run = max(1, n // blocks)
        starts = rng.integers(0, n - run + 1, size=(resamples, -(-n // run)))  # [B, runs]
        picks = h[(starts[..., None] + np.arange(run)).reshape(resamples, -1)[:, :n]]
        paced.append(np.median(picks[..., 0], axis=1) / np.median(picks[..., 1], axis=1))
    ratio = paced[1] / paced[0] - 1.0
    return tuple(float(q) for q in np.quantile(ratio, [0.025, 0.975]))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


async def engine_idle(address: str, timeout_s: float = 30.0) -> dict | None:
    """The engine's status once nothing runs or waits there (None: it did not answer)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = await asyncio.to_thread(engine_status, address)
        if status is None or (status["running"], status["waiting"]) == (0, 0) \
                or time.monotonic() > deadline:
            return status
        await asyncio.sleep(0.2)


def soak_verdict(result: dict, memory: dict, end: dict | None) -> dict:
    """Each criterion's value, limit and pass; `ok` when all pass."""
    failures = result["num_requests"] - result["num_success"]
    # The server's own drift lies between the wall clock's figure (TTFT does not move with
    # the host's speed) and the one at the host's pace (TTFT moves with it as much as decode
    # does, the most bandwidth-bound part): its fixed costs (HTTP, gRPC, scheduling) move
    # less. A drift is shown when both bounds' intervals lie above the limit, and shown below
    # it when both lie below.
    bounds = [(result["ttft_drift"], *result.get("ttft_drift_95", (None, None))),
              (result["ttft_drift_at_host_pace"], *result["ttft_drift_at_host_pace_95"])]
    bounds = [b for b in bounds if b[0] is not None]
    drift = min((b[0] for b in bounds), default=None)
    low = min((b[1] for b in bounds if b[1] is not None), default=None)
    high = max((b[2] for b in bounds), default=None) \
        if all(b[2] is not None for b in bounds) else None
    limit = SOAK_LIMITS["ttft_drift"]
    rss = (memory["engine_rss_drift_mib"] / memory["engine_rss_mib_start"]
           if memory.get("engine_rss_drift_mib") is not None else None)
    blocks = None if end is None else (end["kv_blocks_total"] - end["kv_blocks_free"])
    checks = {
        "failures": {"value": failures, "limit": SOAK_LIMITS["failures"],
                     "ok": failures <= SOAK_LIMITS["failures"]},
        # A minute of requests pins the drift down to about +-5%: the run fails when its
        # interval lies wholly above the limit (TTFT shown to grow by more), and says whether
        # it showed the drift below the limit.
        "ttft_drift": {"value": drift, "limit": SOAK_LIMITS["ttft_drift"],
                       "ok": drift is not None and (low is None or low < limit),
                       "interval_95": [low, high],
                       "shown_below_limit": high is not None and high < limit,
                       "note": "TTFT p50 second half / first half, the lesser of the wall "
                               f"clock's {_pct(result['ttft_drift'])} and the host's pace's "
                               f"{_pct(result['ttft_drift_at_host_pace'])} (per the half's "
                               f"inter-token p50); 95% interval of both {_pct(low)} .. "
                               f"{_pct(high)}"},
        "engine_rss_drift": {"value": rss, "limit": SOAK_LIMITS["engine_rss_drift"],
                             "ok": rss is not None and rss < SOAK_LIMITS["engine_rss_drift"],
                             "note": memory.get("note", "after the first tenth (warm-up) "
                                                        "to the end")},
        "kv_blocks_in_use_at_end": {"value": blocks, "limit": 0, "ok": blocks == 0,
                                    "note": "engine idle" if end else "engine unreachable"},
    }
    return {"ok": all(c["ok"] for c in checks.values()), "criteria": checks}


def memory_drift(samples: Sequence[dict], warmup_share: float = 0.1) -> dict:
    """Engine RSS growth from the first sample after the warm-up share to the last sample."""
    rss = [(s["t_s"], s["engine_rss_mib"]) for s in samples if "engine_rss_mib" in s]
    if len(rss) < 2:
        return {"engine_rss_drift_mib": None, "note": "engine pid unknown or too few samples"}
    start = rss[min(len(rss) - 2, int(len(rss) * warmup_share))]
    end = rss[-1]
    hours = (end[0] - start[0]) / 3600
    return {"engine_rss_mib_start": start[1], "engine_rss_mib_end": end[1],
            "engine_rss_drift_mib": end[1] - start[1],
            "engine_rss_drift_mib_per_hour": (end[1] - start[1]) / hours if hours else None}


async def bench_overload(ctx: BenchContext, *, num_requests: int = 32, prompt_tokens: int = 32,
                         max_tokens: int = 32) -> dict:
    gw = ctx.gateway
    requests = [http_request(gw.base_url, "/completions", gw.completion_body(
        ctx.prompts.make(prompt_tokens, seed=900 + i), max_tokens), gw.api_key)
        for i in range(num_requests)]
    t0 = time.perf_counter()
    sent = asyncio.ensure_future(burst(gw.base_url, requests, gw.origin))
    livez = asyncio.create_task(_probe_livez(gw, sent))
    outcomes = await sent
    livez_s = await livez
    # The floor: as many GET /livez at once, the same way, once the burst is over: what any
    # N simultaneous requests cost this gateway (and this client) on this host.
    floor = [o.latency_s for o in await burst(gw.base_url, [http_get(gw.base_url, "/livez")]
                                              * num_requests, gw.origin)]
    accepted = [o for o in outcomes if o.ok]
    rejected = [o for o in outcomes if not o.ok]
    statuses: dict[str, int] = {}
    for o in outcomes:
        key = str(o.status) + (f" {o.drop_reason or o.error_code}" if not o.ok else "")
        statuses[key] = statuses.get(key, 0) + 1
    ctx.progress(f"overload: {len(accepted)} accepted, {len(rejected)} rejected ({statuses})")
    return {"bench": "overload", "num_requests": num_requests, "wall_s": time.perf_counter() - t0,
            "num_accepted": len(accepted), "num_rejected": len(rejected), "by_status": statuses,
            "accepted_latency_s_p50": percentile([o.latency_s for o in accepted], 50),
            "accepted_latency_s_max": max((o.latency_s for o in accepted), default=None),
            "rejected_latency_s_p50": percentile([o.latency_s for o in rejected], 50),
            "rejected_latency_s_p99": percentile([o.latency_s for o in rejected], 99),
            "rejected_latency_s_max": max((o.latency_s for o in rejected), default=None),
            "retry_after_s": sorted({o.retry_after_s for o in rejected
                                     if o.retry_after_s is not None}),
            # /livez probed one at a time while the burst and its streams run
            "livez_probes": len(livez_s), "livez_latency_s_p50": percentile(livez_s, 50),
            "livez_latency_s_p99": percentile(livez_s, 99),
            "livez_burst_latency_s_p50": percentile(floor, 50),
            "livez_burst_latency_s_p99": percentile(floor, 99),
            "rejected_over_livez_burst_p99": _ratio(percentile([o.latency_s for o in rejected],
                                                               99), percentile(floor, 99)),
            "requests": [o.to_dict() for o in outcomes]}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


async def _probe_livez(gateway: Gateway, burst: asyncio.Future, interval_s: float = 0.01
                       ) -> list[float]:
    """Latencies of /livez, one probe at a time every interval_s until the burst is done."""
    latencies: list[float] = []
    await asyncio.sleep(0)  # let the burst's requests go out first
    while not burst.done():
        latencies.append(await gateway.livez())
        await asyncio.sleep(interval_s)
    return latencies


LADDER = (1 / 16, 1 / 8, 1 / 4, 1 / 2, 3 / 4, 0.97, 1.0, 1.25)


async def bench_longctx(ctx: BenchContext, *, fractions: Sequence[float] = LADDER,
                        max_tokens: int = 8) -> dict:
    """Prompt lengths up to and past the window; at or past it the answer must be a clean 400
    (OpenAI error envelope, context_length_exceeded) and the service must keep serving."""
    window, rows = ctx.context_window, []
    for i, fraction in enumerate(fractions):
        target = max(1, round(window * fraction) - (max_tokens if fraction < 1 else 0))
        outcome = await ctx.gateway.complete(ctx.prompts.make(target, seed=700 + i), max_tokens)
        tokens = outcome.prompt_tokens or _tokens_from_error(outcome.error_message)
        expect_ok = tokens < window if tokens is not None else fraction < 1
        clean_400 = (outcome.status == 400 and outcome.error_code == "context_length_exceeded")
        passed = outcome.ok if expect_ok else clean_400
        rows.append({**outcome.to_dict(), "fraction": fraction, "target_prompt_tokens": target,
                     "prompt_tokens": tokens, "expected": "ok" if expect_ok else "400",
                     "passed": passed})
        ctx.progress(f"longctx {fraction:g} x window ({tokens} tokens): status "
                     f"{outcome.status}, {'pass' if passed else 'FAIL'}")
    after = await ctx.gateway.complete(ctx.prompts.make(16, seed=799), 4)
    return {"bench": "longctx", "context_window": window, "rungs": rows,
            "passed": sum(r["passed"] for r in rows), "total": len(rows),
            "serving_after": after.ok}


def _tokens_from_error(message: str | None) -> int | None:
    match = re.search(r"prompt is (\d+) tokens", message or "")
    return int(match[1]) if match else None
