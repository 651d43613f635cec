"""`strata model train-demo` flags -> TrainConfig -> run_training. Progress on stderr; with
--json, one JSON summary object on stdout."""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path

from services.engine.model.demo import strata_home
from services.training.config import MODEL_NAME, TrainConfig

DEFAULTS = TrainConfig()
POSITIVE_INTS = (
    "steps",
    "tokens",
    "layers",
    "experts",
    "top_k",
    "hidden",
    "expert_ffn",
    "context",
    "vocab",
    "batch",
    "threads",
    "eval_tokens",
)
# Safety stop that keeps the default run (tokenizer ~1 min + training + eval) under 30 minutes.
# The default steps are sized to finish well before it; a run it cuts short is not bit-reproducible.
DEFAULT_MAX_MINUTES = 26.0


def build_parser(prog: str = "strata model train-demo") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Train Strata's default qwen3_moe model (byte-level BPE + MoE) on the "
        "running Python's standard library and write a Hugging Face checkpoint.",
    )
    p.add_argument(
        "--output",
        type=Path,
        default=None,
        help="checkpoint directory (default: $STRATA_HOME/models/strata-stdlib-moe)",
    )
    p.add_argument("--seed", type=int, default=DEFAULTS.seed)
    length = p.add_mutually_exclusive_group()
    length.add_argument(
        "--steps", type=int, default=None, help=f"optimizer steps (default {DEFAULTS.steps})"
    )
    length.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="training tokens; steps = ceil(tokens / (batch * context))",
    )
    p.add_argument("--layers", type=int, default=DEFAULTS.layers)
    p.add_argument("--experts", type=int, default=DEFAULTS.experts)
    p.add_argument("--top-k", type=int, default=DEFAULTS.top_k, help="experts routed per token")
    p.add_argument("--hidden", type=int, default=DEFAULTS.hidden)
    p.add_argument("--expert-ffn", type=int, default=DEFAULTS.expert_ffn)
    p.add_argument("--context", type=int, default=DEFAULTS.context)
    p.add_argument("--vocab", type=int, default=DEFAULTS.vocab, help="BPE vocabulary size")
    p.add_argument("--batch", type=int, default=DEFAULTS.batch, help="sequences per step")
    p.add_argument("--lr", type=float, default=DEFAULTS.lr)
    p.add_argument(
        "--aux-coef", type=float, default=DEFAULTS.aux_coef, help="load-balancing loss weight"
    )
    p.add_argument("--threads", type=int, default=DEFAULTS.threads)
    p.add_argument(
        "--max-minutes",
        type=float,
        default=DEFAULT_MAX_MINUTES,
        help="stop training after this many minutes and still write the checkpoint "
        f"(default {DEFAULT_MAX_MINUTES:g}; 0 = no limit)",
    )
    p.add_argument(
        "--eval-tokens",
        type=int,
        default=DEFAULTS.eval_tokens,
        help="held-out tokens scored for the model card",
    )
    p.add_argument(
        "--corpus-max-bytes",
        type=int,
        default=None,
        help="read at most this much text per split (quick runs and tests)",
    )
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default=DEFAULTS.dtype)
    p.add_argument("--json", action="store_true", help="print the run summary as JSON on stdout")
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    tokens_per_step = args.batch * args.context
    if args.tokens is not None:
        steps = max(1, math.ceil(args.tokens / tokens_per_step))
    else:
        steps = args.steps if args.steps is not None else DEFAULTS.steps
    return TrainConfig(
        seed=args.seed,
        layers=args.layers,
        experts=args.experts,
        top_k=args.top_k,
        hidden=args.hidden,
        expert_ffn=args.expert_ffn,
        context=args.context,
        vocab=args.vocab,
        batch=args.batch,
        steps=steps,
        lr=args.lr,
        warmup_steps=min(DEFAULTS.warmup_steps, max(1, steps // 10)),
        aux_coef=args.aux_coef,
        threads=args.threads,
        max_minutes=args.max_minutes or None,
        eval_tokens=args.eval_tokens,
        corpus_max_bytes=args.corpus_max_bytes,
        dtype=args.dtype,
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in POSITIVE_INTS:
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.top_k > args.experts:
        parser.error("--top-k must not exceed --experts")
    if args.vocab < 259 + 1:
        parser.error("--vocab must exceed 259 (256 bytes + 3 special tokens)")
    if args.hidden % (32 if args.hidden >= 128 else 16):
        parser.error("--hidden must be a multiple of 16 (of 32 from 128 up)")
    cfg = config_from_args(args)
    output = args.output or strata_home() / "models" / MODEL_NAME
    from services.training.pipeline import run_training  # torch import only when training

    command = shlex.join(["strata", "model", "train-demo", *argv])
    summary = run_training(cfg, output, command=command)
    if args.json:
        print(
            json.dumps(
                {k: v for k, v in summary.items() if k != "train"}
                | {"train": {k: v for k, v in summary["train"].items() if k != "losses"}}
            )
        )
    return 0
