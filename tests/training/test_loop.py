"""The model and the training loop: determinism, learning, the schedule, the time limit."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from services.training.config import TrainConfig, param_budget
from services.training.loop import Batches, lr_at, train
from services.training.moe import MoETransformer
from tests.training.conftest import TINY


def repeated_corpus(vocab: int = 64, period: int = 48, repeats: int = 60) -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.tile(rng.integers(3, vocab, size=period), repeats).astype(np.uint16)


def fit(cfg: TrainConfig, tokens: np.ndarray, vocab: int = 64):
    torch.manual_seed(cfg.seed)
    model = MoETransformer(cfg, vocab)
    return model, train(model, tokens, cfg, log=lambda line: None)


def test_training_is_deterministic_for_a_seed():
    cfg = dataclasses.replace(TINY, steps=6, context=32)
    _, a = fit(cfg, repeated_corpus())
    _, b = fit(cfg, repeated_corpus())
    _, c = fit(dataclasses.replace(cfg, seed=1), repeated_corpus())
    assert a.losses == b.losses and a.aux_losses == b.aux_losses
    assert a.losses != c.losses


def test_loss_goes_down_on_a_repeated_corpus():
    cfg = dataclasses.replace(TINY, steps=40, context=32, lr=1e-2, warmup_steps=4)
    _, result = fit(cfg, repeated_corpus())
    first, last = np.mean(result.losses[:3]), np.mean(result.losses[-5:])
    assert first > 3.5  # ~ln(64) at the start
    assert last < 0.5 * first, result.losses
    assert all(0.9 < a < 2.5 for a in result.aux_losses)  # 1.0 = balanced


def test_max_minutes_stops_early():
    cfg = dataclasses.replace(TINY, steps=50, context=32, max_minutes=0.0)
    _, result = fit(cfg, repeated_corpus())
    assert result.stopped_early and result.steps_done == 1


def test_batches_are_seeded_windows():
    tokens = np.arange(1000, dtype=np.uint16)
    a, b = Batches(tokens, 16, 4, seed=3), Batches(tokens, 16, 4, seed=3)
    x, y = a.next()
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
    assert torch.equal(x, b.next()[0])
    assert all(int(row[0]) % 16 == 0 for row in x)  # window starts on the stride


def test_lr_warms_up_then_decays_to_the_floor():
    cfg = dataclasses.replace(TINY, steps=100, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(1e-4)
    assert lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(99, cfg) == pytest.approx(1e-4, rel=0.05)
    assert lr_at(50, cfg) < lr_at(20, cfg)


def test_param_budget_counts_the_module():
    model = MoETransformer(TINY, 300)
    budget = param_budget(TINY, 300)
    assert budget.total == sum(p.numel() for p in model.parameters())
    default = param_budget(TrainConfig(), 4096)
    assert default.checkpoint_bytes() < 40 * 2**20  # the shipped recipe stays well under 50 MB


def test_router_balances_and_counts_assignments():
    torch.manual_seed(0)
    model = MoETransformer(TINY, 300)
    out = model(torch.randint(0, 300, (2, 16)))
    assert out.logits.shape == (2, 16, 300)
    assert out.expert_counts.shape == (TINY.layers, TINY.experts)
    assert (out.expert_counts.sum(dim=1) == 2 * 16 * TINY.top_k).all()
    assert out.aux_loss.item() == pytest.approx(1.0, abs=0.3)
