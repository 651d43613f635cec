"""`strata bench grammar`: what constrained decoding costs, in-process.

    strata bench grammar [--model DIR] [--batch 1 8] [--tokens T] [--repeat R] [--threads N]
                         [--json] [--out DIR]

For each batch size, R rounds, each: B plain requests (greedy, ignore_eos, T tokens), then B
requests of the same prompts under a JSON schema (an array of 100 to 1000 records, so that the
grammar cannot close before T tokens), run to completion on the engine's own loop. Reported per
batch size: decode tok/s of both (medians over rounds; the rounds interleave, as the host's speed
drifts), their ratio, and per engine step the time llguidance spent on the batch's masks (in its
thread, beside the forward) and the time the sampler still waited for them, as a share of the
constrained step. The target of #23: mask cost < 10% of the decode step at batch 8.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

SCHEMA = {"type": "array", "minItems": 100, "maxItems": 1000, "items": {
    "type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": {"type": "string", "maxLength": 16},
        "kind": {"enum": ["module", "class", "function"]}},
    "required": ["id", "name", "kind"], "additionalProperties": False}}
PROMPTS = ["def parse_args(argv):", "import os\n", "class Config:", "The standard library",
           "for line in lines:", "# Copyright", "return {", "def __init__(self,"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="strata bench grammar", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="checkpoint (default: the shipped "
                   "default model)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--tokens", type=int, default=96, help="tokens per request")
    p.add_argument("--repeat", type=int, default=3, help="rounds per batch size")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", type=Path, default=None, help="also write grammar.json/.md here")
    return p


def _run(engine: Any, batch: int, tokens: int, constrained: bool) -> dict[str, float]:
    from services.engine.grammar import OutputConstraint
    from services.engine.requests import EngineRequest, Finished, GenerateParams

    constraint = OutputConstraint("json_schema", json.dumps(SCHEMA)) if constrained else None
    left = threading.Semaphore(0)
    stats: list = []

    def sink(event: object) -> None:
        if isinstance(event, Finished):
            stats.append(event.stats)
            left.release()

    steps_before = engine.steps
    t0 = time.perf_counter()
    for i in range(batch):
        engine.submit(EngineRequest(f"g{i}", GenerateParams(
            max_tokens=tokens, ignore_eos=True, constraint=constraint),
            prompt=PROMPTS[i % len(PROMPTS)]), sink)
    for _ in range(batch):
        left.acquire()
    wall = time.perf_counter() - t0
    steps = engine.steps - steps_before
    generated = sum(s.completion_tokens for s in stats)
    return {"tok_s": generated / wall, "tokens": generated, "steps": steps,
            "step_ms": wall / steps * 1e3,
            "compute_ms_per_step": sum(s.grammar_compute_ms for s in stats) / steps,
            "wait_ms_per_step": sum(s.grammar_wait_ms for s in stats) / steps,
            "complete": sum(s.completion_tokens == tokens for s in stats)}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    from services.engine.core import Engine
    from services.engine.runner import ModelRunner
    from services.models import default_model_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model or default_model_dir()
    runner = ModelRunner(model, cache_slots=None, device_memory_bytes=8 << 30,
                         reserved_bytes=0)
    runner.fill_cache(runner.layer_order_pairs())
    engine = Engine(runner, max_running=max(args.batch))
    engine.start()
    rows = []
    try:
        for batch in args.batch:
            _run(engine, batch, 8, True)  # warm-up: kernels, the grammar's tokenizer
            rounds: list[tuple[dict, dict]] = []
            for r in range(args.repeat):
                plain = _run(engine, batch, args.tokens, False)
                guided = _run(engine, batch, args.tokens, True)
                rounds.append((plain, guided))
                print(f"strata bench grammar: batch {batch} round {r + 1}/{args.repeat}: plain "
                      f"{plain['tok_s']:.1f} tok/s, constrained {guided['tok_s']:.1f} tok/s, "
                      f"masks {guided['compute_ms_per_step']:.3f} ms/step computed, "
                      f"{guided['wait_ms_per_step']:.3f} ms/step waited", file=sys.stderr,
                      flush=True)
            med = statistics.median
            step_ms = med(g["step_ms"] for _, g in rounds)
            rows.append({
                "batch": batch, "tokens": args.tokens,
                "plain_tok_s": med(p["tok_s"] for p, _ in rounds),
                "constrained_tok_s": med(g["tok_s"] for _, g in rounds),
                "ratio": med(g["tok_s"] / p["tok_s"] for p, g in rounds),
                "step_ms": step_ms,
                "mask_compute_ms_per_step": med(g["compute_ms_per_step"] for _, g in rounds),
                "mask_wait_ms_per_step": med(g["wait_ms_per_step"] for _, g in rounds),
                "mask_compute_share": med(g["compute_ms_per_step"] / g["step_ms"]
                                          for _, g in rounds),
                "mask_wait_share": med(g["wait_ms_per_step"] / g["step_ms"] for _, g in rounds),
                "constrained_ran_full_length": min(g["complete"] for _, g in rounds) == batch,
                "rounds": [{"plain": p, "constrained": g} for p, g in rounds]})
    finally:
        engine.stop()
    out = {"bench": "grammar", "model": str(model), "threads": torch.get_num_threads(),
           "schema": SCHEMA, "rows": rows}
    text = render(out)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "grammar.json").write_text(json.dumps(out, indent=1))
        (args.out / "grammar.md").write_text(text)
    print(json.dumps(out) if args.json else text)
    return 0


def render(out: dict[str, Any]) -> str:
    lines = ["# strata bench grammar", "",
             f"model `{Path(out['model']).name}`, {out['threads']} threads; constrained: a JSON "
             "schema (an array of records) held open for every token", "",
             "| batch | plain tok/s | constrained tok/s | ratio | step ms | masks computed "
             "ms/step (share) | sampler waited ms/step (share) |", "|---|---|---|---|---|---|---|"]
    for r in out["rows"]:
        lines.append(
            f"| {r['batch']} | {r['plain_tok_s']:.1f} | {r['constrained_tok_s']:.1f} | "
            f"{r['ratio']:.2f}x | {r['step_ms']:.2f} | {r['mask_compute_ms_per_step']:.3f} "
            f"({r['mask_compute_share']:.1%}) | {r['mask_wait_ms_per_step']:.3f} "
            f"({r['mask_wait_share']:.1%}) |")
    return "\n".join(lines) + "\n"
