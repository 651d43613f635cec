"""`bench run`: short decode, long prefill at ~1/8 and ~1/2 of the window, quality checks.

Every bench gets a BenchContext (the gateway, what is known about the engine behind it, a
calibrated PromptMaker) and returns a plain dict that becomes the result JSON.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from services.bench.client import Gateway, Outcome, discover
from services.bench.prompts import PromptMaker, QualitySet, agreement, quality_path, text
from services.bench.stats import percentile


def stderr_progress(prefix: str) -> Callable[[str], None]:
    def say(message: str) -> None:
        print(f"{prefix}: {message}", file=sys.stderr, flush=True)
    return say


@dataclass
class BenchContext:
    gateway: Gateway
    engine: dict
    context_window: int
    prompts: PromptMaker = field(default_factory=PromptMaker)
    progress: Callable[[str], None] = lambda message: None

    def describe(self) -> dict:
        return {"url": self.gateway.base_url, "model": self.gateway.model,
                "context_window": self.context_window,
                "chars_per_token": round(self.prompts.chars_per_token, 4)}


async def open_context(gateway: Gateway, context_window: int | None,
                       progress: Callable[[str], None]) -> BenchContext:
    """Find the engine (GetStatus through the gateway's health) and calibrate prompt length."""
    engine = await discover(gateway)
    window = context_window or engine.get("context_window") or await probe_window(gateway)
    ctx = BenchContext(gateway, engine, window, progress=progress)
    sample = text(200, seed=-1)  # short: little prefill routing in the engine's counts
    probe = await gateway.complete(sample, 1)
    if not probe.ok:
        raise RuntimeError(f"calibration request failed: {probe.status} {probe.error_message}")
    ctx.prompts.calibrate(len(sample), probe.prompt_tokens or 0)
    progress(f"model {gateway.model}, context window {window} tokens, "
             f"{ctx.prompts.chars_per_token:.2f} chars/token, engine "
             f"{engine.get('engine_id', 'unknown')} ({engine.get('slots', '?')} slots)")
    return ctx


async def probe_window(gateway: Gateway) -> int:
    """Ask with an oversized prompt and read the window from the 400's message."""
    outcome = await gateway.complete(text(400_000, seed=-2), 1)
    match = re.search(r"context window is (\d+) tokens", outcome.error_message or "")
    if not match:
        raise RuntimeError("cannot tell the model's context window; pass --context-window")
    return int(match[1])


def summarize(outcomes: Sequence[Outcome]) -> dict:
    ok = [o for o in outcomes if o.ok]

    def pct(key: str, q: float) -> float | None:
        values = [getattr(o, key) for o in ok if getattr(o, key) is not None]
        return percentile(values, q)

    return {"num_requests": len(outcomes), "num_ok": len(ok),
            "num_failed": len(outcomes) - len(ok),
            "ttft_s_p50": pct("ttft_s", 50), "ttft_s_p95": pct("ttft_s", 95),
            "latency_s_p50": pct("latency_s", 50), "latency_s_p95": pct("latency_s", 95),
            "prefill_tok_s_p50": pct("prefill_tok_s", 50),
            "decode_tok_s_p50": pct("decode_tok_s", 50),
            "client_decode_tok_s_p50": pct("client_decode_tok_s", 50),
            "hit_rate_p50": pct("hit_rate", 50), "spill_ratio_p50": pct("spill_ratio", 50),
            "prompt_tokens_p50": pct("prompt_tokens", 50),
            "completion_tokens": sum(o.completion_tokens or 0 for o in ok)}


async def _case(ctx: BenchContext, name: str, prompt_tokens: int, max_tokens: int,
                repeat: int, seed: int) -> dict:
    outcomes = []
    for i in range(repeat):
        prompt = ctx.prompts.make(prompt_tokens, seed=seed + i)
        outcome = await ctx.gateway.complete(prompt, max_tokens)
        outcomes.append(outcome)
        ctx.progress(f"{name} {i + 1}/{repeat}: {_brief(outcome)}")
    return {"name": name, "target_prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
            **summarize(outcomes), "requests": [o.to_dict() for o in outcomes]}


def _brief(o: Outcome) -> str:
    if not o.ok:
        return f"FAILED {o.status} {o.error_code}: {o.error_message}"
    decode = f"{o.decode_tok_s:.1f}" if o.decode_tok_s else "-"
    return (f"{o.prompt_tokens} prompt + {o.completion_tokens} generated tokens, TTFT "
            f"{o.ttft_s * 1e3:.0f} ms, decode {decode} tok/s, hit rate "
            f"{(o.hit_rate or 0):.1%}")


async def quality_checks(ctx: BenchContext, path: Path | None) -> dict:
    """Greedy continuations against the recorded set: exact matches, and the agreement (share of
    each expected answer reproduced before the first difference)."""
    path = path or quality_path(ctx.gateway.model or "model")
    if not path.is_file():
        return {"name": "quality", "skipped": f"no recorded answers at {path}; record them "
                "with `strata bench quality --model DIR`", "passed": 0, "total": 0}
    qset = QualitySet.load(path)
    checks = []
    for prompt, expected in qset.cases:
        outcome = await ctx.gateway.complete(prompt, qset.max_tokens)
        checks.append({"prompt": prompt, "expected": expected, "got": outcome.text,
                       "passed": outcome.ok and outcome.text == expected,
                       "agreement": agreement(expected, outcome.text) if outcome.ok else 0.0,
                       "status": outcome.status, "ttft_s": outcome.ttft_s})
    passed = sum(c["passed"] for c in checks)
    mean_agreement = sum(c["agreement"] for c in checks) / max(len(checks), 1)
    ctx.progress(f"quality: {passed}/{len(checks)} exact matches, agreement "
                 f"{mean_agreement:.1%}")
    shown = path.resolve()
    if shown.is_relative_to(Path.cwd()):
        shown = shown.relative_to(Path.cwd())
    return {"name": "quality", "file": str(shown), "model": qset.model, "passed": passed,
            "total": len(checks), "agreement": mean_agreement, "checks": checks}


async def bench_run(ctx: BenchContext, *, decode_tokens: int = 128, repeat: int = 3,
                    short_prompt_tokens: int = 32, prefill_fractions: Sequence[float] = (1 / 8,
                                                                                      1 / 2),
                    prefill_max_tokens: int = 16, quality_file: Path | None = None,
                    skip_quality: bool = False) -> dict:
    started = time.perf_counter()
    cases = [await _case(ctx, "short_decode", short_prompt_tokens, decode_tokens, repeat, 100)]
    for i, fraction in enumerate(prefill_fractions):
        tokens = int(ctx.context_window * fraction) - prefill_max_tokens
        name = f"prefill_{_fraction_name(fraction)}_window"
        cases.append(await _case(ctx, name, tokens, prefill_max_tokens, 1, 200 + 10 * i))
    quality = ({"name": "quality", "skipped": "--skip-quality", "passed": 0, "total": 0}
               if skip_quality else await quality_checks(ctx, quality_file))
    return {"bench": "run", "cases": cases, "quality": quality,
            "total_wall_s": time.perf_counter() - started}


def _fraction_name(fraction: float) -> str:
    inverse = 1 / fraction
    return f"1_{round(inverse)}" if abs(inverse - round(inverse)) < 1e-6 else f"{fraction:g}"
