"""`strata bench quality`: record a model's quality set with the fp32 reference path.

    strata bench quality [--model DIR] [--count 12] [--max-tokens 24] [--output FILE]

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

    from services.engine.runner import ModelRunner

    runner = ModelRunner(model_dir, device="cpu", device_memory_bytes=2**40, reserved_bytes=0,
                         dtype=torch.float32, kv_dtype="auto", prefix_reuse=False)
    assert runner.slots == runner.total_pairs, "the reference path keeps every expert resident"
    eos = runner.tokenizer.eos_token_ids
    cases = []
    for i, prompt in enumerate(prompts):
        seq = runner.start(runner.tokenizer.encode(prompt))
        logits = runner.prefill(seq)
        ids: list[int] = []
        while len(ids) < max_tokens:
            token = int(torch.argmax(logits[:runner.num_usable_tokens]))
            if token in eos:
                break
            ids.append(token)
            if len(ids) < max_tokens:
                logits = runner.decode(seq, token)
        runner.release(seq)
        cases.append((prompt, runner.tokenizer.decode(ids), tuple(ids)))
        if progress:
            progress(f"quality: recorded {i + 1}/{len(prompts)}")
    return QualitySet(runner.model_name, max_tokens,
                      tuple((p, text) for p, text, _ in cases),
                      tuple(ids for _, _, ids in cases))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="strata bench quality", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="checkpoint directory (default: the "
                        "default model)")
    parser.add_argument("--count", type=int, default=DEFAULT_COUNT, help="snippets")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    parser.add_argument("--output", type=Path, help="quality file (default: the one `strata "
                        "bench run` reads for this model, services/bench/quality/MODEL.json)")
    args = parser.parse_args(argv)
    from services.models import default_model_dir

    model_dir = args.model or default_model_dir()
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
