"""`strata model train-mtp`: train a multi-token-prediction head for a trained checkpoint.

    checkpoint (frozen) ── MoETransformer forward ──> h [B, T+1, D] (before the final norm)
    head(h[:, :T], embed(x[:, 1:T+1])) -> final norm -> lm_head (frozen, shared) -> x[:, 2:T+2]

Only the head (services/engine/spec/mtp_head.py) trains, on windows of the checkpoint's own
training split (the standard library, services/training/corpus.py), in a seeded order from a
seeded init: the same flags and thread count give the same head. The held-out split scores it
(next-next-token loss and top-1 accuracy); the head is written beside the main weights as
mtp.safetensors + strata_mtp.json (bf16), which transformers never reads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from services.engine.spec.mtp_head import DEFAULT_WINDOW, MtpConfig, MtpHead, save_mtp_head
from services.training.bpe import split_ids
from services.training.config import TrainConfig
from services.training.moe import MoETransformer


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="strata model train-mtp",
        description="Train a multi-token-prediction draft head (--spec-method mtp) for a "
        "trained checkpoint; the checkpoint itself stays frozen and unchanged.")
    p.add_argument("--model", type=Path, default=None,
                   help="checkpoint directory (default: the shipped default model)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=8, help="windows per step")
    p.add_argument("--context", type=int, default=128, help="positions per window")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                   help="the head's attention window (positions)")
    p.add_argument("--mlp", type=int, default=256, help="the head's dense MLP width")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--corpus-max-bytes", type=int, default=4 * 2**20,
                   help="text read per split (default 4 MiB)")
    p.add_argument("--eval-tokens", type=int, default=8192)
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    return p


def load_frozen(model_dir: Path) -> MoETransformer:
    """The checkpoint as the training-side MoETransformer (experts re-stacked), frozen."""
    from safetensors.torch import load_file

    c = json.loads((model_dir / "config.json").read_text())
    cfg = TrainConfig(layers=c["num_hidden_layers"], experts=c["num_experts"],
                      top_k=c["num_experts_per_tok"], hidden=c["hidden_size"],
                      expert_ffn=c["moe_intermediate_size"], context=c["max_position_embeddings"],
                      vocab=c["vocab_size"], rope_theta=c.get("rope_theta", 10000.0),
                      norm_topk_prob=c.get("norm_topk_prob", True))
    assert (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads) == (
        c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]), "unexpected shape"
    model = MoETransformer(cfg, c["vocab_size"])
    tensors = {k: v.float() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    state: dict[str, torch.Tensor] = {}
    for name in model.state_dict():
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith(".mlp.experts"):  # per-expert HF keys -> stacked [E, ...]
            state[name] = torch.stack([tensors[f"{prefix}.{e}.{leaf}.weight"]
                                       for e in range(cfg.experts)])
        elif name == "lm_head.weight" and name not in tensors:
            state[name] = tensors["model.embed_tokens.weight"]
        else:
            state[name] = tensors[name]
    model.load_state_dict(state)
    return model.eval().requires_grad_(False)


def hidden_states(model: MoETransformer, ids: torch.Tensor) -> torch.Tensor:
    """ids [B, T] -> the last hidden state [B, T, D] before the final norm."""
    seen: list[torch.Tensor] = []
    hook = model.model.norm.register_forward_hook(lambda _m, inp, _o: seen.append(inp[0]))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        hook.remove()
    return seen[0]


def mtp_loss(model: MoETransformer, head: MtpHead, window: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """window [B, T+2] -> (mean next-next-token loss, top-1 hits [B*T])."""
    T = window.shape[1] - 2
    h = hidden_states(model, window[:, :T])  # [B, T, D]: h_i reads x_0..x_i
    e = model.model.embed_tokens(window[:, 1:T + 1])  # [B, T, D]: x_{i+1}
    positions = torch.arange(T).expand(window.shape[0], T)  # [B, T]
    g = head(h, e, positions)  # [B, T, D]
    logits = model.lm_head(model.model.norm(g)).float()  # [B, T, V]
    targets = window[:, 2:].reshape(-1)  # x_{i+2}
    flat = logits.reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, targets), flat.argmax(-1) == targets


def train_mtp(model_dir: Path, args: argparse.Namespace, log: Any = print,
              command: str = "") -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    model = load_frozen(model_dir)
    train_ids = split_ids("train", model_dir / "tokenizer.json", None, args.corpus_max_bytes)
    heldout_ids = split_ids("heldout", model_dir / "tokenizer.json", None, args.corpus_max_bytes)
    c = json.loads((model_dir / "config.json").read_text())
    config = MtpConfig(c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"],
                       c["head_dim"], args.mlp, args.window, c["rms_norm_eps"],
                       c.get("rope_theta", 10000.0))
    torch.manual_seed(args.seed)
    head = MtpHead(config)
    with torch.no_grad():  # small init; the residual outputs smaller still
        for name, p in head.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.02 / (2 if name.endswith(("o_proj.weight", "down_proj.weight"))
                                       else 1))
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.01)
    span = args.context + 2
    tokens = torch.from_numpy(train_ids.astype(np.int64))
    num_windows = (len(tokens) - 1) // span
    order = torch.randperm(num_windows, generator=torch.Generator().manual_seed(args.seed))
    log(f"train-mtp: {model_dir.name}, head of {config.num_params() / 1e3:.0f}k params; "
        f"{len(train_ids)} train / {len(heldout_ids)} held-out tokens; {args.steps} steps x "
        f"{args.batch} x {args.context}")
    t0, losses = time.perf_counter(), []
    for step in range(args.steps):
        lr = args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 20)
        idx = [int(order[(step * args.batch + b) % num_windows]) for b in range(args.batch)]
        batch = torch.stack([tokens[i * span:(i + 1) * span] for i in idx])  # [B, T+2]
        loss, _ = mtp_loss(model, head, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == args.steps - 1:
            log(f"train-mtp: step {step + 1}/{args.steps} loss {loss.item():.4f} "
                f"({time.perf_counter() - t0:.0f} s)")
    elapsed = time.perf_counter() - t0
    heldout = evaluate_mtp(model, head, heldout_ids, args.context, args.eval_tokens)
    summary = {"command": command,
               "seed": args.seed, "steps": args.steps, "batch": args.batch,
               "context": args.context, "lr": args.lr, "threads": args.threads,
               "train_tokens_seen": args.steps * args.batch * args.context,
               "elapsed_s": round(elapsed, 1),
               "final_train_loss": round(sum(losses[-10:]) / len(losses[-10:]), 4),
               "heldout": heldout}
    path = save_mtp_head(model_dir, head, summary)
    log(f"train-mtp: wrote {path} ({path.stat().st_size / 2**20:.2f} MiB); held-out "
        f"next-next-token loss {heldout['loss']:.4f}, top-1 accuracy {heldout['accuracy']:.3f}")
    return summary


@torch.no_grad()
def evaluate_mtp(model: MoETransformer, head: MtpHead, ids: np.ndarray, context: int,
                 max_tokens: int) -> dict[str, Any]:
    span = context + 2
    count = max(1, min((len(ids) - 1) // span, max_tokens // context))
    tokens = torch.from_numpy(ids[: count * span].astype(np.int64)).view(count, span)
    total, hits, n = 0.0, 0, 0
    for chunk in torch.split(tokens, 8):
        loss, top1 = mtp_loss(model, head, chunk)
        total += loss.item() * top1.numel()
        hits += int(top1.sum())
        n += top1.numel()
    return {"loss": round(total / n, 4), "accuracy": round(hits / n, 4), "num_tokens": n}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if min(args.steps, args.batch, args.context, args.window, args.mlp, args.threads) < 1:
        raise SystemExit("strata model train-mtp: sizes must be >= 1")
    from services.models import default_model_dir

    model_dir = args.model or default_model_dir()

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    command = shlex.join(["strata", "model", "train-mtp", *argv])
    summary = train_mtp(Path(model_dir), args, log, command)
    if args.json:
        print(json.dumps(summary))
    return 0
