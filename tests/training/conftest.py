"""Fixtures for the training tests: one tiny end-to-end training run shared by the session
(2 layers x 4 experts, hidden 32, vocab 300, 20 steps on ~100 KB of the stdlib, 1 thread)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.training.config import TrainConfig

TINY = TrainConfig(
    seed=0,
    layers=2,
    experts=4,
    top_k=2,
    hidden=32,
    expert_ffn=32,
    context=64,
    vocab=300,
    batch=4,
    steps=20,
    warmup_steps=2,
    threads=1,
    eval_tokens=512,
    corpus_max_bytes=100_000,
)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> tuple[Path, dict]:
    """(checkpoint dir, run summary) of a tiny training run."""
    from services.training.pipeline import run_training

    out = tmp_path_factory.mktemp("train") / "tiny-stdlib-moe"
    summary = run_training(TINY, out, log=lambda line: None)
    return out, summary


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from more threads, and oversubscribed cores make them crawl."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
