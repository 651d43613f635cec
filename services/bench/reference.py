"""`strata bench quality`: record a model's quality set with the fp32 reference path, or
compare a served dtype against that reference.

    strata bench quality [--model DIR] [--count 12] [--max-tokens 24] [--output FILE]
    strata bench quality --compare-dtype bf16 [--model DIR] [--tokens 2048] [--cpu-kernels M]

The prompts are code snippets of the held-out modules of the default model's corpus (the Python
standard library; text the trained model never saw). Each expected answer is the greedy
continuation computed by the reference path: one sequence at a time, every expert resident, fp32
weights and KV. `strata bench run` then checks the serving path against the file (exact match
for fp32 KV; the agreement figure shows how close int8 KV comes), and so does the engine's test
suite across cache sizes, policies and batch shapes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from services.bench.prompts import QualitySet, quality_path

DEFAULT_COUNT = 12
DEFAULT_MAX_TOKENS = 24
SNIPPET_CHARS = 240


def quality_prompts(count: int = DEFAULT_COUNT) -> list[str]:
    from services.training.corpus import snippets

    return snippets("heldout", count, max_chars=SNIPPET_CHARS)


def record_quality(model_dir: Path, prompts: list[str], max_tokens: int = DEFAULT_MAX_TOKENS,
                   progress=None) -> QualitySet:
    """Greedy continuations of `prompts` from the reference path."""
    import torch

    from services.engine.driver import SequenceDriver
    from services.engine.runner import ModelRunner

    runner = ModelRunner(model_dir, device="cpu", device_memory_bytes=2**40, reserved_bytes=0,
                         dtype=torch.float32, kv_dtype="auto")
    drive = SequenceDriver(runner)
    assert runner.slots == runner.total_pairs, "the reference path keeps every expert resident"
    eos = runner.tokenizer.eos_token_ids
    cases = []
    for i, prompt in enumerate(prompts):
        seq = drive.start(runner.tokenizer.encode(prompt))
        logits = drive.prefill(seq)
        ids: list[int] = []
        while len(ids) < max_tokens:
            token = int(torch.argmax(logits[:runner.num_usable_tokens]))
            if token in eos:
                break
            ids.append(token)
            if len(ids) < max_tokens:
                logits = drive.decode(seq, token)
        drive.release(seq)
        cases.append((prompt, runner.tokenizer.decode(ids), tuple(ids)))
        if progress:
            progress(f"quality: recorded {i + 1}/{len(prompts)}")
    return QualitySet(runner.model_name, max_tokens,
                      tuple((p, text) for p, text, _ in cases),
                      tuple(ids for _, _, ids in cases))


def compare_dtype(model_dir: Path, dtype: str = "bf16", num_tokens: int = 2048,
                  cpu_kernels: str = "auto", progress=None) -> dict:
    """Teacher-forced next-token predictions on the held-out split's first windows (the ones
    `strata bench quant` and the model card score, about num_tokens targets), in `dtype`
    against the fp32 reference: top-1 agreement, both held-out losses and the relative change,
    the largest logit difference."""
    import torch.nn.functional as F

    from services.bench.quant_bench import load_runner, position_logits
    from services.training.bpe import split_ids
    from services.training.evaluate import eval_windows

    runners = {name: load_runner(model_dir, "auto", dtype=name, cpu_kernels=cpu_kernels)
               for name in ("fp32", dtype)}
    context = next(iter(runners.values())).config.context_window
    ids = split_ids("heldout", Path(model_dir) / "tokenizer.json",
                    max_bytes=8 * num_tokens)[:num_tokens + num_tokens // context + 1]
    windows = eval_windows(ids, context, num_tokens)  # [W, T+1]
    nll = {name: 0.0 for name in runners}
    agree = count = 0
    max_diff = 0.0
    for window in windows:
        targets = window[1:]  # [T]
        logits = {name: position_logits(r, window[:-1].tolist())[:, :r.num_usable_tokens]
                  for name, r in runners.items()}  # [T, V] each
        for name, lg in logits.items():
            nll[name] += float(F.cross_entropy(lg, targets, reduction="sum"))
        ref, got = logits["fp32"], logits[dtype]
        agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
        count += len(targets)
        max_diff = max(max_diff, float((ref - got).abs().max()))
        if progress:
            progress(f"quality: compared {count} predictions")
    loss = {name: total / count for name, total in nll.items()}
    return {"model": Path(model_dir).name, "dtype": dtype,
            "backend": runners[dtype].backend.describe(), "predictions": count,
            "top1_agreement": agree / count, "heldout_loss_fp32": loss["fp32"],
            f"heldout_loss_{dtype}": loss[dtype],
            "loss_change": (loss[dtype] - loss["fp32"]) / loss["fp32"],
            "max_abs_logit_diff": max_diff,
            "activations": str(runners[dtype].dtype).removeprefix("torch.")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="strata bench quality", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="checkpoint directory (default: the "
                        "default model)")
    parser.add_argument("--count", type=int, default=DEFAULT_COUNT, help="snippets")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    parser.add_argument("--output", type=Path, help="quality file (default: the one `strata "
                        "bench run` reads for this model, services/bench/quality/MODEL.json)")
    parser.add_argument("--compare-dtype", choices=("bf16",), help="instead of recording: "
                        "this dtype's teacher-forced predictions on held-out text against the "
                        "fp32 reference (top-1 agreement, held-out loss change)")
    parser.add_argument("--tokens", type=int, default=2048, help="with --compare-dtype")
    parser.add_argument("--cpu-kernels", choices=("auto", "on", "off"), default="auto",
                        help="with --compare-dtype: the engine's --cpu-kernels")
    args = parser.parse_args(argv)
    from services.models import default_model_dir

    model_dir = args.model or default_model_dir()
    if args.compare_dtype:
        print(json.dumps(compare_dtype(
            model_dir, args.compare_dtype, args.tokens, args.cpu_kernels,
            progress=lambda line: print(f"strata bench {line}", file=sys.stderr, flush=True))))
        return 0
    qset = record_quality(model_dir, quality_prompts(args.count), args.max_tokens,
                          progress=lambda line: print(f"strata bench {line}", file=sys.stderr,
                                                      flush=True))
    path = args.output or quality_path(qset.model)
    qset.write(path, note="greedy continuations of held-out standard-library snippets, recorded "
               "with the fp32 reference path by `strata bench quality` (batch 1, every expert "
               "resident, fp32 KV); `strata bench run` checks them by exact match")
    print(json.dumps({"path": str(path), "model": qset.model, "cases": len(qset.cases),
                      "max_tokens": qset.max_tokens}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
