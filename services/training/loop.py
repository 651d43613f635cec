"""The training loop: deterministic batches, AdamW with warmup + cosine decay, progress lines.

Determinism: the model is initialised after torch.manual_seed(seed); the batch order comes from
its own torch.Generator(seed); CPU kernels at a fixed thread count are deterministic. The same
seed, data and settings therefore give the same loss sequence (`--max-minutes` is a safety stop:
when it fires, the run is cut short at a time-dependent step).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from services.training.config import TrainConfig, format_count, format_duration
from services.training.moe import MoETransformer, lm_loss

Log = Callable[[str], None]


def stderr_log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Batches:
    """The token stream cut into non-overlapping windows of T+1 tokens (stride T), visited in a
    seeded random order, reshuffled each epoch. next() -> inputs, targets [B, T] (int64)."""

    def __init__(self, tokens: np.ndarray, context: int, batch: int, seed: int):
        assert len(tokens) > context, f"need more than {context} tokens, have {len(tokens)}"
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        self.T, self.B = context, batch
        self.num_windows = (len(tokens) - 1) // context
        self.gen = torch.Generator().manual_seed(seed)
        self.order = torch.empty(0, dtype=torch.int64)
        self.pos = 0
        self.epoch = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = []
        for _ in range(self.B):
            if self.pos >= len(self.order):
                self.order = torch.randperm(self.num_windows, generator=self.gen)
                self.pos = 0
                self.epoch += 1
            starts.append(int(self.order[self.pos]) * self.T)
            self.pos += 1
        windows = torch.stack([self.tokens[s : s + self.T + 1] for s in starts])  # [B, T+1]
        return windows[:, :-1], windows[:, 1:]


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr, then cosine decay to cfg.lr * min_lr_ratio at cfg.steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


@dataclass
class TrainResult:
    steps_done: int = 0
    tokens_seen: int = 0
    elapsed_s: float = 0.0
    stopped_early: bool = False  # --max-minutes fired
    losses: list[float] = field(default_factory=list)
    aux_losses: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_seen / self.elapsed_s if self.elapsed_s > 0 else 0.0


def train(
    model: MoETransformer,
    tokens: np.ndarray,
    cfg: TrainConfig,
    log: Log = stderr_log,
    log_every: int | None = None,
) -> TrainResult:
    """Run cfg.steps optimizer steps (or until cfg.max_minutes) on windows of `tokens`."""
    batches = Batches(tokens, cfg.context, cfg.batch, cfg.seed)
    opt = make_optimizer(model, cfg)
    log_every = log_every or max(1, cfg.steps // 50)
    deadline_s = cfg.max_minutes * 60 if cfg.max_minutes is not None else math.inf
    result = TrainResult()
    model.train()
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        inputs, targets = batches.next()
        out = model(inputs)
        loss = lm_loss(out.logits, targets)
        (loss + cfg.aux_coef * out.aux_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

        result.steps_done = step + 1
        result.tokens_seen += inputs.numel()
        result.losses.append(loss.item())
        result.aux_losses.append(out.aux_loss.item())
        result.elapsed_s = time.perf_counter() - t0
        last = step + 1 == cfg.steps
        if result.elapsed_s >= deadline_s and not last:
            result.stopped_early = True
            log(f"train: --max-minutes {cfg.max_minutes:g} reached at step {step + 1}; stopping")
            break
        if step < 3 or (step + 1) % log_every == 0 or last:
            log(progress_line(step + 1, cfg, result, lr_at(step, cfg)))
    model.eval()
    return result


def progress_line(step: int, cfg: TrainConfig, r: TrainResult, lr: float) -> str:
    rate = r.tokens_per_s
    eta_s = (cfg.steps - step) * cfg.tokens_per_step / rate if rate else math.inf
    return (
        f"step {step}/{cfg.steps}  loss {r.losses[-1]:.4f}  aux {r.aux_losses[-1]:.3f}  "
        f"lr {lr:.2e}  {format_count(rate)} tok/s  "
        f"elapsed {format_duration(r.elapsed_s)}  ETA {format_duration(eta_s)}"
    )
