"""Held-out evaluation: next-token loss, a unigram baseline on the same targets, and routing
statistics (how the learned router spreads (layer, expert) load on held-out text)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch

from services.training.moe import MoETransformer, lm_loss


@dataclass(frozen=True)
class EvalResult:
    loss: float  # mean next-token cross-entropy, nats
    num_tokens: int  # targets scored
    unigram_loss: float  # add-one unigram model from training counts, same targets
    expert_counts: np.ndarray  # [L, E] routed assignments on the held-out windows

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    @property
    def unigram_perplexity(self) -> float:
        return math.exp(self.unigram_loss)


def eval_windows(tokens: np.ndarray, context: int, max_tokens: int) -> torch.Tensor:
    """The first non-overlapping windows [W, T+1] of the held-out stream, about max_tokens
    targets in all (at least one window; shorter than T+1 if the stream is)."""
    T = min(context, len(tokens) - 1)
    assert T >= 1, "held-out stream is empty"
    count = max(1, min((len(tokens) - 1) // T, max_tokens // T))
    ids = torch.from_numpy(tokens[: count * T + 1].astype(np.int64))
    return torch.stack([ids[i * T : i * T + T + 1] for i in range(count)])


@torch.no_grad()
def evaluate(
    model: MoETransformer,
    heldout: np.ndarray,
    train_tokens: np.ndarray,
    max_tokens: int,
    batch: int = 8,
) -> EvalResult:
    model.eval()
    windows = eval_windows(heldout, model.cfg.context, max_tokens)
    total_loss, counts = 0.0, None
    for chunk in torch.split(windows, batch):
        out = model(chunk[:, :-1])
        total_loss += lm_loss(out.logits, chunk[:, 1:]).item() * chunk[:, 1:].numel()
        counts = out.expert_counts if counts is None else counts + out.expert_counts
    targets = windows[:, 1:].reshape(-1).numpy()
    assert counts is not None
    return EvalResult(
        loss=total_loss / targets.size,
        num_tokens=int(targets.size),
        unigram_loss=unigram_loss(train_tokens, targets, model.vocab_size),
        expert_counts=counts.numpy(),
    )


def unigram_loss(train_tokens: np.ndarray, targets: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy of an add-one-smoothed unigram model fitted on the training stream."""
    counts = np.bincount(train_tokens.astype(np.int64), minlength=vocab_size).astype(np.float64)
    log_p = np.log((counts + 1.0) / (counts.sum() + vocab_size))
    return float(-log_p[targets.astype(np.int64)].mean())


@dataclass(frozen=True)
class LayerRouting:
    layer: int
    entropy: float  # of the layer's expert-load distribution, nats
    entropy_ratio: float  # entropy / log(E): 1.0 = perfectly even load
    top25_share: float  # share of the layer's routings taken by its busiest 25% of experts
    max_share: float  # the busiest expert's share


@dataclass(frozen=True)
class RoutingStats:
    layers: list[LayerRouting]
    pair_top_share: dict[str, float]  # "10%"/"25%"/"50%" of all pairs -> share of routings

    def as_dict(self) -> dict:
        return {"layers": [asdict(x) for x in self.layers], "pair_top_share": self.pair_top_share}


def routing_stats(counts: np.ndarray) -> RoutingStats:
    """counts [L, E] -> per-layer load entropy and concentration, and the share of all routings
    covered by the hottest 10/25/50% of (layer, expert) pairs."""
    counts = counts.astype(np.float64)
    L, E = counts.shape
    layers = []
    for layer in range(L):
        row = counts[layer]
        p = row / row.sum() if row.sum() else np.full(E, 1.0 / E)
        nz = p[p > 0]
        entropy = float(-(nz * np.log(nz)).sum())
        top = np.sort(p)[::-1]
        layers.append(
            LayerRouting(
                layer=layer,
                entropy=entropy,
                entropy_ratio=entropy / math.log(E) if E > 1 else 1.0,
                top25_share=float(top[: max(1, E // 4)].sum()),
                max_share=float(top[0]),
            )
        )
    flat = np.sort(counts.reshape(-1))[::-1]
    total = flat.sum() or 1.0
    pair_top = {
        f"{pct}%": float(flat[: max(1, round(flat.size * pct / 100))].sum() / total)
        for pct in (10, 25, 50)
    }
    return RoutingStats(layers, pair_top)
