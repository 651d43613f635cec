"""RoPE scaling (model/layers/rope.py) against transformers' own ROPE_INIT_FUNCTIONS: the inverse
frequencies and the factor on cos and sin of every supported rope_type, read from the config
fields transformers writes; DeepSeek's YaRN softmax correction against its attention module.
The models run with them end to end: tests/engine/test_model_families.py (deepseek_v2/v3 with
YaRN) and test_model_reference.py (qwen3_moe with YaRN, linear, llama3)."""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from services.engine.model.config import CheckpointError  # noqa: E402
from services.engine.model.families import parse_config  # noqa: E402
from services.engine.model.layers.rope import inv_frequencies, softmax_correction  # noqa: E402

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=32, moe_intermediate_size=16,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            num_experts=4, num_experts_per_tok=2, max_position_embeddings=4096)
THETA = 1_000_000.0
ROPES = {
    "linear": dict(rope_type="linear", factor=4.0),
    "dynamic": dict(rope_type="dynamic", factor=2.0),
    "llama3": dict(rope_type="llama3", factor=8.0, original_max_position_embeddings=512,
                   low_freq_factor=1.0, high_freq_factor=4.0),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024),
    "yarn-qwen3": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024,
                       beta_fast=32.0, beta_slow=1.0, truncate=False),
    "yarn-attention-factor": dict(rope_type="yarn", factor=2.0, attention_factor=0.8,
                                  original_max_position_embeddings=2048),
    "yarn-mscale": dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=128,
                        mscale=0.707, mscale_all_dim=0.707),  # DeepSeek-V2-Lite's
}


def hf_config(rope: dict):
    return transformers.Qwen3MoeConfig(**BASE, rope_parameters={"rope_theta": THETA, **rope})


@pytest.mark.parametrize("name", list(ROPES))
def test_inverse_frequencies_and_attention_factor_are_transformers(name):
    config = hf_config(ROPES[name])
    want, want_factor = ROPE_INIT_FUNCTIONS[ROPES[name]["rope_type"]](config, "cpu")
    ours = parse_config(config.to_dict())
    assert ours.rope_theta == THETA and ours.rope_scaling.rope_type == ROPES[name]["rope_type"]
    got, factor = inv_frequencies(ours.head_dim, ours.rope_theta, ours.rope_scaling,
                                  ours.context_window)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(want_factor, rel=1e-12)
    if name != "dynamic":  # inside the window dynamic NTK is the default RoPE
        default, _ = inv_frequencies(ours.head_dim, THETA, None, ours.context_window)
        assert not torch.allclose(got, default)


def test_deepseek_v3_s_published_yarn_and_its_softmax_correction():
    """DeepSeek-V3's rope_scaling (factor 40 over 4096 positions, mscale = mscale_all_dim = 1):
    cos and sin unscaled, the attention scale times mscale(40, 1)^2 as its attention computes."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, beta_fast=32, beta_slow=1,
                mscale=1.0, mscale_all_dim=1.0, original_max_position_embeddings=4096)
    config = transformers.DeepseekV3Config(
        vocab_size=300, hidden_size=64, intermediate_size=32, moe_intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, max_position_embeddings=163840, rope_parameters=rope,
        n_group=1, topk_group=1)
    ours = parse_config(config.to_dict())
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    got, factor = inv_frequencies(ours.qk_rope_head_dim, ours.rope_theta, ours.rope_scaling,
                                  ours.context_window)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    assert factor == want_factor == 1.0
    attention = DeepseekV3Attention(config, layer_idx=0)
    correction = attention.scaling / config.qk_head_dim**-0.5
    assert softmax_correction(ours.rope_scaling, ours.context_window) == pytest.approx(
        correction, rel=1e-12)
    assert correction == pytest.approx((0.1 * math.log(40) + 1) ** 2)


@pytest.mark.parametrize(("rope", "message"), [
    (dict(rope_type="longrope", factor=4.0), "longrope"),
    (dict(rope_type="yarn", factor=4.0), "original_max_position_embeddings"),
    (dict(rope_type="linear"), "factor"),
])
def test_unsupported_or_incomplete_rope_is_named(rope, message):
    raw = {**BASE, "model_type": "qwen3_moe", "rope_parameters": {"rope_theta": THETA, **rope}}
    with pytest.raises(CheckpointError, match=message):
        parse_config(raw)


DEEPSEEK_V3_CONFIG = {  # deepseek-ai/DeepSeek-V3's config.json (the fields Strata reads)
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc",
    "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid",
    "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-06,
    "rope_theta": 10000, "tie_word_embeddings": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                            "quant_method": "fp8", "weight_block_size": [128, 128]},
}


def test_the_published_deepseek_v3_config_is_read_with_its_yarn():
    """Refused before RoPE scaling was read; now its YaRN (the old `type` spelling) is."""
    c = parse_config(DEEPSEEK_V3_CONFIG)
    assert c.rope_scaling.rope_type == "yarn" and c.rope_scaling.factor == 40
    assert c.rope_scaling.original_max_position_embeddings == 4096
    assert c.context_window == 163840 and len(c.moe_layers) == 58
    assert softmax_correction(c.rope_scaling, c.context_window) == pytest.approx(
        (0.1 * math.log(40) + 1) ** 2)
