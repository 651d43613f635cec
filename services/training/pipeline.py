"""One training run end to end: corpus -> tokenizer -> ids -> model -> train -> eval -> checkpoint."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from services.training.bpe import encode_corpus, train_bpe
from services.training.config import (
    MODEL_NAME,
    TrainConfig,
    format_count,
    format_duration,
    param_budget,
)
from services.training.corpus import iter_texts, split_summary, stdlib_root
from services.training.evaluate import evaluate, routing_stats
from services.training.export import write_checkpoint
from services.training.loop import Log, stderr_log, train
from services.training.moe import MoETransformer


def run_training(
    cfg: TrainConfig,
    output: Path,
    command: str = "strata model train-demo",
    log: Log = stderr_log,
    root: Path | None = None,
) -> dict[str, Any]:
    """Train per `cfg`, write the checkpoint to `output`; returns the run summary."""
    threads_before = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        return _run(cfg, Path(output), command, log, root)
    finally:
        torch.set_num_threads(threads_before)


def _run(
    cfg: TrainConfig, output: Path, command: str, log: Log, root: Path | None
) -> dict[str, Any]:
    os.environ.setdefault("RAYON_NUM_THREADS", str(cfg.threads))  # the tokenizers thread pool
    root = Path(root) if root is not None else stdlib_root()
    timings: dict[str, float] = {}

    t0 = time.perf_counter()
    train_texts = list(iter_texts("train", root, cfg.corpus_max_bytes))
    heldout_texts = list(iter_texts("heldout", root, cfg.corpus_max_bytes))
    tok = train_bpe(train_texts, cfg.vocab)
    vocab_size = tok.get_vocab_size()
    timings["tokenizer_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    train_ids = encode_corpus(tok, train_texts)
    heldout_ids = encode_corpus(tok, heldout_texts)
    timings["encode_s"] = time.perf_counter() - t0
    log(
        f"train-demo: corpus {len(train_texts)} train / {len(heldout_texts)} held-out files from "
        f"{root}; BPE vocab {vocab_size}; {format_count(len(train_ids))} train / "
        f"{format_count(len(heldout_ids))} held-out tokens "
        f"({timings['tokenizer_s'] + timings['encode_s']:.1f} s)"
    )

    budget = param_budget(cfg, vocab_size)
    planned = cfg.steps * cfg.tokens_per_step
    log(
        f"train-demo: budget {format_count(budget.total)} params "
        f"({format_count(budget.active_per_token)} active/token, "
        f"{format_count(budget.train_flops_per_token)} train FLOP/token), checkpoint ~"
        f"{budget.checkpoint_bytes() / 2**20:.1f} MiB {cfg.dtype}; {cfg.steps} steps x "
        f"{cfg.tokens_per_step} = {format_count(planned)} tokens "
        f"({planned / max(1, len(train_ids)):.2f} epochs); ETA follows the first steps"
    )

    torch.manual_seed(cfg.seed)
    model = MoETransformer(cfg, vocab_size)
    result = train(model, train_ids, cfg, log)
    timings["train_s"] = result.elapsed_s

    t0 = time.perf_counter()
    ev = evaluate(model, heldout_ids, train_ids, cfg.eval_tokens)
    timings["eval_s"] = time.perf_counter() - t0
    routing = routing_stats(ev.expert_counts)

    tail = result.losses[-10:]
    summary: dict[str, Any] = {
        "name": MODEL_NAME,
        "output": str(output),
        "command": command,
        "recipe": cfg.as_dict(),
        "shape": {
            "num_heads": cfg.num_heads,
            "num_kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
        },
        "vocab_size": vocab_size,
        "params": {
            "total": budget.total,
            "active_per_token": budget.active_per_token,
            "experts": budget.experts,
        },
        "corpus": {
            "python_version": platform.python_version(),
            "stdlib": str(root),
            "split": split_summary(root).as_dict(),
            "train_files_read": len(train_texts),
            "heldout_files_read": len(heldout_texts),
            "train_tokens": int(len(train_ids)),
            "heldout_tokens": int(len(heldout_ids)),
        },
        "train": {
            "steps_done": result.steps_done,
            "tokens_seen": result.tokens_seen,
            "elapsed_s": round(result.elapsed_s, 2),
            "tokens_per_s": round(result.tokens_per_s, 1),
            "stopped_early": result.stopped_early,
            "first_loss": result.losses[0] if result.losses else None,
            "final_loss": sum(tail) / len(tail) if tail else None,
            "losses": [round(x, 5) for x in result.losses],
        },
        "heldout": {
            "loss": ev.loss,
            "perplexity": ev.perplexity,
            "unigram_loss": ev.unigram_loss,
            "unigram_perplexity": ev.unigram_perplexity,
            "perplexity_ratio": ev.perplexity / ev.unigram_perplexity,
            "num_tokens": ev.num_tokens,
        },
        "routing": routing.as_dict(),
        "timings_s": {k: round(v, 2) for k, v in timings.items()},
    }
    write_checkpoint(output, model, cfg, tok, summary)
    log(
        f"train-demo: wrote {output} ({summary['checkpoint_bytes'] / 2**20:.1f} MiB): held-out "
        f"loss {ev.loss:.4f} (ppl {ev.perplexity:.2f}; unigram {ev.unigram_perplexity:.2f}); "
        f"{result.steps_done} steps in {format_duration(result.elapsed_s)} at "
        f"{result.tokens_per_s:.0f} tok/s"
    )
    return summary
