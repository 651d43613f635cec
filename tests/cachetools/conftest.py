"""A tiny demo-writer checkpoint and one routing trace recorded on it, shared by the tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.engine.model.demo import write_demo_checkpoint

TINY = dict(num_hidden_layers=3, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
            num_experts_per_tok=2, max_position_embeddings=512, vocab_size=320)


@pytest.fixture(scope="session")
def tools_model(tmp_path_factory) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp("ckpt") / "tools-tiny", seed=3, **TINY)


@pytest.fixture(scope="session")
def live_trace(tools_model, tmp_path_factory):
    """(trace path, runner) after two sampled requests at 6 slots, default policy."""
    from services.engine.driver import SequenceDriver
    from services.engine.runner import ModelRunner
    from services.engine.sampling import Sampler, SamplingConfig

    path = tmp_path_factory.mktemp("trace") / "live.trace"
    runner = ModelRunner(tools_model, cache_slots=6, reserved_bytes=0,
                         record_routing=path)
    drive = SequenceDriver(runner)
    runner.fill_cache(runner.layer_order_pairs(), source="layer order")
    for seed, prompt in enumerate(("Tell me about caches.", "Something else: tides.")):
        sampler = Sampler(SamplingConfig(temperature=0.8, seed=seed))
        seq = drive.start(runner.tokenizer.encode(prompt))
        logits = drive.prefill(seq)
        for _ in range(24):
            logits = drive.decode(seq, sampler.sample(logits))
        drive.release(seq)
    runner.close()
    return path, runner
