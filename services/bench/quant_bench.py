"""`strata bench quant`: what quantized experts cost in quality, measured on Strata's forward.

    strata bench quant [--model DIR] [--dtypes auto int8 int4] [--max-tokens N] [--json]

Held-out text is the training corpus's held-out split (services.training.corpus: whole stdlib
modules the default model never saw), encoded with the model's tokenizer, each file followed by
<|endoftext|>, cut into the windows of services.training.evaluate.eval_windows (the model card's
held-out loss uses the same ones). Each window is one prefill step through the engine's forward
with logits at every position, every pair resident (residency never changes outputs). Per expert
dtype: slot bytes, held-out loss and perplexity with the change against the first dtype (the
reference), top-1 agreement with the reference (its argmax at each position), next-token
accuracy, and forward tokens/s.

Entry point: `main(argv) -> int`. With `--json` exactly one JSON object goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from services.engine.model.quant import EXPERT_DTYPES

DEFAULT_MAX_TOKENS = 16384
MAX_CONTEXT = 512  # the default model's training context


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="strata bench quant",
        description="Held-out perplexity "
        "and top-1 agreement of quantized experts on Strata's forward.",
    )
    p.add_argument(
        "--model", type=Path, help="checkpoint directory (default: the shipped default model)"
    )
    p.add_argument(
        "--dtypes",
        nargs="+",
        choices=EXPERT_DTYPES,
        default=list(EXPERT_DTYPES),
        help="expert dtypes; the first is the reference (default: auto int8 int4)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help="held-out targets scored (the model card uses 65536)",
    )
    p.add_argument(
        "--context",
        type=int,
        help=f"window length (default: the model's context window, at most {MAX_CONTEXT})",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


@torch.no_grad()
def position_logits(runner: Any, token_ids: list[int]) -> torch.Tensor:
    """fp32 logits [T, V] at every position of one fresh sequence (one prefill step)."""
    from services.engine.driver import SequenceDriver

    drive = SequenceDriver(runner)
    try:
        return drive.score(token_ids).cpu()
    finally:
        drive.close()


def load_runner(model_dir: Path, expert_dtype: str, device: str = "cpu", dtype: str = "auto",
                cpu_kernels: str = "auto") -> Any:
    """A runner with every pair resident."""
    from services.engine.runner import ModelRunner

    runner = ModelRunner(
        model_dir,
        device=device,
        device_memory_bytes=2**50,
        reserved_bytes=0,
        expert_dtype=expert_dtype,
        dtype=dtype,
        cpu_kernels=cpu_kernels,
    )
    runner.fill_cache(runner.layer_order_pairs(), source="layer order")
    return runner


def score(
    model_dir: Path, dtypes: list[str], windows: torch.Tensor, device: str = "cpu"
) -> list[dict[str, Any]]:
    """Per dtype: loss over the windows [W, T+1], top-1 agreement with dtypes[0], accuracy."""
    results: list[dict[str, Any]] = []
    reference: list[torch.Tensor] = []  # argmax [T] per window, of dtypes[0]
    for expert_dtype in dtypes:
        runner = load_runner(model_dir, expert_dtype, device)
        nll = agree = correct = 0.0
        t0 = time.perf_counter()
        for w, window in enumerate(windows):
            logits = position_logits(runner, window[:-1].tolist())  # [T, V]
            targets = window[1:]  # [T]
            nll += F.cross_entropy(logits, targets, reduction="sum").item()
            top1 = logits.argmax(dim=-1)  # [T]
            correct += (top1 == targets).sum().item()
            if not results:
                reference.append(top1)
            agree += (top1 == reference[w]).sum().item()
        elapsed_s = time.perf_counter() - t0
        n = windows[:, 1:].numel()
        loss = nll / n
        row = {
            "expert_dtype": expert_dtype,
            "slot_bytes": runner.slot_bytes,
            "loss": loss,
            "perplexity": math.exp(loss),
            "top1_agreement": agree / n,
            "accuracy": correct / n,
            "num_tokens": n,
            "tokens_per_s": n / elapsed_s,
        }
        ref = results[0] if results else row
        row["slot_ratio"] = row["slot_bytes"] / ref["slot_bytes"]
        row["perplexity_change"] = row["perplexity"] / ref["perplexity"] - 1.0
        results.append(row)
        del runner
    return results


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from services.engine.model.checkpoint import load_model_config
    from services.models import default_model_dir
    from services.training.bpe import split_ids
    from services.training.evaluate import eval_windows

    model_dir = args.model or default_model_dir()
    context = args.context or min(load_model_config(model_dir).context_window, MAX_CONTEXT)
    ids = split_ids("heldout", model_dir / "tokenizer.json")
    ids = ids[: args.max_tokens + args.max_tokens // context + 1]
    windows = eval_windows(ids, context, args.max_tokens)  # [W, T+1]
    print(
        f"[bench quant] {model_dir.name}: {windows.shape[0]} held-out windows of "
        f"{windows.shape[1] - 1} tokens; dtypes {' '.join(args.dtypes)}",
        file=sys.stderr,
    )
    rows = score(model_dir, args.dtypes, windows, args.device)
    result = {
        "model": model_dir.name,
        "context": windows.shape[1] - 1,
        "num_windows": windows.shape[0],
        "rows": rows,
    }
    print(json.dumps(result) if args.json else render(result))
    return 0


def render(result: dict[str, Any]) -> str:
    from services.bench.report import table

    rows = result["rows"]
    ref = rows[0]["expert_dtype"]
    head = (
        f"{result['model']}: {result['num_windows']} held-out windows x {result['context']} "
        f"tokens; reference {ref}"
    )
    return (
        head
        + "\n"
        + table(
            [
                "experts",
                "slot bytes",
                "slot ratio",
                "held-out loss",
                "perplexity",
                "ppl change",
                f"top-1 agreement vs {ref}",
                "accuracy",
                "tok/s",
            ],
            [
                [
                    r["expert_dtype"],
                    r["slot_bytes"],
                    f"{r['slot_ratio']:.3f}",
                    f"{r['loss']:.4f}",
                    f"{r['perplexity']:.3f}",
                    f"{r['perplexity_change']:+.2%}",
                    f"{r['top1_agreement']:.2%}",
                    f"{r['accuracy']:.2%}",
                    f"{r['tokens_per_s']:.0f}",
                ]
                for r in rows
            ],
        )
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
