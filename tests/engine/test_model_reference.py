"""Strata's Qwen3-MoE forward against transformers' reference implementation, in fp32."""

from __future__ import annotations

import pytest
import torch

from services.engine.driver import SequenceDriver
from services.engine.runner import ModelRunner
from tests.engine.conftest import TOKENIZER_VOCAB

PROMPT = "<|im_start|>user\nWhich experts are hot today?<|im_end|>\n<|im_start|>assistant\n"


def assert_matches_reference(model_dir, ref, steps: int = 16, atol: float = 1e-4,
                             cpu_kernels: str = "auto") -> None:
    runner = ModelRunner(model_dir, cache_slots=0, reserved_bytes=0, dtype="fp32",
                         cpu_kernels=cpu_kernels)
    drive = SequenceDriver(runner)
    ids = runner.tokenizer.encode(PROMPT)
    seq = drive.start(ids)
    logits = drive.prefill(seq)
    for step in range(steps + 1):
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0, -1, :TOKENIZER_VOCAB]
        diff = (logits[:TOKENIZER_VOCAB] - want).abs().max().item()
        assert diff <= atol, f"step {step}: max abs diff {diff}"
        if step < steps:
            token = int(logits.argmax())
            assert token == int(want.argmax())
            ids.append(token)
            logits = drive.decode(seq, token)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),  # 4 q / 2 kv heads, 2 of 8 routed, no renormalization
        dict(
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=8,
            num_experts_per_tok=3,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),  # dense layer in the middle
        dict(
            num_attention_heads=2,
            num_key_value_heads=2,
            num_experts=6,
            num_experts_per_tok=1,
            decoder_sparse_step=2,
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,
        ),
        # RoPE scaling (model/layers/rope.py), over 32 of 256 positions
        dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                  original_max_position_embeddings=32)),
        dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0)),
        dict(rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0,
                                  original_max_position_embeddings=32, low_freq_factor=1.0,
                                  high_freq_factor=4.0)),
    ],
    ids=["gqa-top2", "top3-norm-dense-layer", "mha-top1-sparse-step-tied", "yarn", "linear",
         "llama3"],
)
def test_logits_match_transformers(hf_checkpoint, overrides):
    model_dir, ref = hf_checkpoint(**overrides)
    assert_matches_reference(model_dir, ref)


def test_sharded_checkpoint_with_index_matches(hf_checkpoint):
    model_dir, ref = hf_checkpoint("sharded", seed=3, max_shard_size="100KB")
    assert (model_dir / "model.safetensors.index.json").is_file()
    assert len(list(model_dir.glob("*.safetensors"))) > 1
    assert_matches_reference(model_dir, ref, steps=4)


def test_demo_checkpoint_matches_transformers(demo_dir):
    from transformers import Qwen3MoeForCausalLM

    ref = Qwen3MoeForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()
    assert ref.config.num_local_experts == 32 and ref.config.num_hidden_layers == 8
    assert_matches_reference(demo_dir, ref, steps=4)
