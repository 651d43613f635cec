"""The shipped default model (services/models/strata-stdlib-moe): it loads, matches transformers,
and the serving path reproduces its recorded quality set at any cache size, policy and batch."""

from __future__ import annotations

import json

import pytest
import torch

from services.bench.prompts import QualitySet, agreement, quality_path
from services.bench.reference import compare_dtype
from services.engine import kernels
from services.engine.cache.policy import PolicySpec
from services.engine.core import Engine
from services.engine.model.checkpoint import load_model_config
from services.engine.runner import ModelRunner
from services.models import DEFAULT_MODEL_NAME, default_model_dir
from tests.engine.test_batching import Client, request
from tests.engine.test_model_reference import assert_matches_reference

MODEL = default_model_dir()
QUALITY = QualitySet.load(quality_path(DEFAULT_MODEL_NAME))


def test_the_default_model_ships_small_with_its_card_and_tokenizer():
    files = {p.name: p.stat().st_size for p in MODEL.iterdir()}
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "README.md"):
        assert name in files, f"{name} missing from {MODEL}"
    assert sum(files.values()) < 50 * 2**20
    config = json.loads((MODEL / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["torch_dtype"] == "bfloat16"
    assert "perplexity" in (MODEL / "README.md").read_text()


@pytest.mark.parametrize("cpu_kernels", ["auto", "off"])
def test_the_default_model_matches_transformers(cpu_kernels):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    assert_matches_reference(MODEL, ref, steps=8, cpu_kernels=cpu_kernels)


@pytest.mark.parametrize("cpu_kernels", ["auto", "off"])
def test_bf16_serving_agrees_with_the_fp32_reference(cpu_kernels):
    """The default model is stored in bf16 and served in bf16 (--dtype auto). The CPU kernels
    widen its weights exactly into fp32 products: the fp32 reference's logits, bit for bit.
    Torch ops round each product's input to bf16: close, not equal (this flat model's near
    ties flip in about 2% of positions; the held-out loss barely moves)."""
    r = compare_dtype(MODEL, "bf16", num_tokens=1100, cpu_kernels=cpu_kernels)
    assert r["predictions"] >= 600 and abs(r["loss_change"]) <= 0.005, r
    if cpu_kernels == "auto" and kernels.find_compiler() is not None:  # so they must build
        assert r["top1_agreement"] == 1.0 and r["max_abs_logit_diff"] == 0.0, r
    else:
        assert r["top1_agreement"] >= 0.96 and r["max_abs_logit_diff"] > 0.0, r


def test_quality_set_is_held_out_code_with_token_ids():
    assert QUALITY.model == DEFAULT_MODEL_NAME and len(QUALITY.cases) >= 8
    assert len(QUALITY.token_ids) == len(QUALITY.cases)
    assert all(prompt.startswith(("def ", "class ")) for prompt, _ in QUALITY.cases)
    assert sum(len(ids) for ids in QUALITY.token_ids) >= 4 * len(QUALITY.cases)


def run_quality(engine: Engine, batch: int) -> list[list[int]]:
    """Greedy continuations of the quality prompts, `batch` requests in flight at a time."""
    out: list[list[int]] = []
    prompts = [prompt for prompt, _ in QUALITY.cases]
    for start in range(0, len(prompts), batch):
        clients = [Client() for _ in prompts[start:start + batch]]
        for prompt, client in zip(prompts[start:start + batch], clients, strict=True):
            engine.submit(request(prompt, max_tokens=QUALITY.max_tokens, temperature=0.0),
                          client)
        out += [client.wait(120).tokens for client in clients]
    return out


@pytest.mark.parametrize(
    ("coverage", "policy", "batch", "step_tokens"),
    [(1.0, "crf", 1, 512), (0.25, "crf", 12, 64), (0.1, "lru", 5, 32), (0.5, "lfu", 12, 512)],
    ids=["full-alone", "quarter-crf-batch12-chunked", "tenth-lru-batch5", "half-lfu-batch12"],
)
def test_serving_path_reproduces_the_quality_set(coverage, policy, batch, step_tokens):
    slots = round(coverage * load_model_config(MODEL).total_pairs)
    runner = ModelRunner(MODEL, cache_slots=slots, reserved_bytes=0, policy=PolicySpec(policy))
    engine = Engine(runner, max_running=batch, max_step_tokens=step_tokens)
    engine.start()
    try:
        got = run_quality(engine, batch)
    finally:
        engine.stop()
    assert got == [list(ids) for ids in QUALITY.token_ids]


def test_int8_kv_mostly_reproduces_the_quality_set():
    runner = ModelRunner(MODEL, device_memory_bytes=2**40, reserved_bytes=0, kv_dtype="int8")
    engine = Engine(runner, max_running=12, max_step_tokens=512)
    engine.start()
    try:
        got = run_quality(engine, 12)
    finally:
        engine.stop()
    texts = [runner.tokenizer.decode(ids) for ids in got]
    shares = [agreement(expected, text) for (_, expected), text in zip(QUALITY.cases, texts,
                                                                       strict=True)]
    assert sum(shares) / len(shares) >= 0.75, shares
