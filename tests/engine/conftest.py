"""Fixtures for the engine's model/cache/runner tests: tiny random qwen3_moe checkpoints written
by transformers (the reference) or by Strata's demo writer, all on the CPU."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from services.engine.model.demo import write_byte_tokenizer, write_demo_checkpoint

TOKENIZER_VOCAB = 259  # 256 bytes + 3 special tokens (the demo byte-level tokenizer)

TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=256,
)


def fixed_bytes(model_dir: Path, **kwargs) -> int:
    """What the budget rule subtracts before the cache for this checkpoint and settings: its
    non-expert weights and KV pool (read off a runner without a cache)."""
    return _fixed_bytes(Path(model_dir), tuple(sorted(kwargs.items())))


@functools.cache
def _fixed_bytes(model_dir: Path, kwargs: tuple) -> int:
    from services.engine.runner import ModelRunner

    size = ModelRunner(model_dir, cache_slots=0, reserved_bytes=0, **dict(kwargs)).cache_size
    return size.weight_bytes + size.kv_bytes


def make_hf_checkpoint(
    path: Path, seed: int = 0, max_shard_size: str | None = None, **overrides
) -> tuple[Path, torch.nn.Module]:
    """save_pretrained() a seeded random Qwen3MoeForCausalLM plus the byte tokenizer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**{**TINY, **overrides})
    model = Qwen3MoeForCausalLM(config).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    write_byte_tokenizer(path, context_window=config.max_position_embeddings)
    return path, model


@pytest.fixture
def hf_checkpoint(tmp_path):
    """Factory: hf_checkpoint(name, **config_overrides) -> (dir, reference model)."""

    def make(name: str = "tiny-moe", **kwargs):
        return make_hf_checkpoint(tmp_path / name, **kwargs)

    return make


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A small demo-writer checkpoint shared by cache/runner tests: 3 layers x 8 experts."""
    return write_demo_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "tiny-demo",
        seed=1,
        num_hidden_layers=3,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        vocab_size=320,
    )


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo") / "strata-demo-moe")


@pytest.fixture(scope="session")
def tiny_bf16_dir(tiny_dir, tmp_path_factory) -> Path:
    """tiny_dir's weights stored in bf16 (served in bf16 under --dtype auto)."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("ckpt") / "tiny-demo-bf16"
    shutil.copytree(tiny_dir, out)
    weights = {k: v.to(torch.bfloat16) for k, v in load_file(out / "model.safetensors").items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


NO_COMPILER = "no C compiler here ($CC, cc, gcc, clang): the CPU kernels cannot be built"


@pytest.fixture(scope="session")
def cpu():
    """The C kernels (services/engine/kernels), built once. Skipped only where there is no C
    compiler: with one, a build that fails fails the test."""
    from services.engine import kernels

    if kernels.find_compiler() is None:
        pytest.skip(NO_COMPILER)
    return kernels.CpuKernels(kernels.build())
