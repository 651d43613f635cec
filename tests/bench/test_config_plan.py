"""`strata plan --config` (services/bench/config_plan.py): a model's budget terms from its
config.json alone. The architecture's non-expert parameter count equals the count over the
tensors of a real checkpoint of every family, and a pair's bytes equal the engine's slot."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
from services.bench.config_plan import FORMATS, config_plan, non_expert_params, pair_bytes  # noqa: E402
from services.bench.plan_cli import plan_main  # noqa: E402
from services.engine.model.checkpoint import load_model_config, open_checkpoint  # noqa: E402
from services.engine.model.families import parse_config, weight_names  # noqa: E402
from services.engine.runner import non_expert_bytes, slot_bytes_of  # noqa: E402
from tests.engine.conftest import make_hf_checkpoint  # noqa: E402
from tests.engine.test_fp8_checkpoint import fp8_pair  # noqa: E402, F401 - a fixture
from tests.engine.test_model_families import FAMILIES, make_family_checkpoint  # noqa: E402
from tests.engine.test_rope_scaling import DEEPSEEK_V3_CONFIG  # noqa: E402

VARIANTS = [("qwen3_moe", {}), ("qwen3_moe", dict(mlp_only_layers=[1]))] + [
    (f, {}) for f in FAMILIES] + [
    ("deepseek_v3", dict(q_lora_rank=24)), ("glm4_moe", dict(use_qk_norm=True)),
    ("qwen2_moe", dict(tie_word_embeddings=True, mlp_only_layers=[1]))]


@pytest.mark.parametrize(("family", "overrides"), VARIANTS,
                         ids=[f"{f}-{'-'.join(o) or 'default'}" for f, o in VARIANTS])
def test_the_architecture_counts_what_a_checkpoint_holds(tmp_path, family, overrides):
    if family == "qwen3_moe":
        model_dir, _ = make_hf_checkpoint(tmp_path / family, **overrides)
    else:
        model_dir, _ = make_family_checkpoint(tmp_path / family, family, **overrides)
    c = load_model_config(model_dir)
    reader = open_checkpoint(model_dir, weight_names(c))
    assert non_expert_params(c) * 4 == non_expert_bytes(reader, torch.float32, c.num_layers)
    assert pair_bytes(c, "bf16") == slot_bytes_of(model_dir, "bf16")
    assert pair_bytes(c, "int4") == slot_bytes_of(model_dir, "bf16", "int4")


def test_published_configs_plan_every_format(tmp_path, capsys):
    """DeepSeek-V3's published config: 58 MoE layers x 256 experts, a Q4_K pair is its
    2048 + 2048 rows of 7168 and 7168 rows of 2048 in 144-byte super-blocks; an expert width
    that is not whole 256-weight super-blocks has no K-quant (n/a)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(DEEPSEEK_V3_CONFIG))
    assert plan_main(["--config", str(path), "--json", "--kv-tokens", "4096"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pairs"] == 58 * 256 and out["device_mib"] == [24576, 32768, 49152]
    rows = {r["format"]: r for r in out["formats"]}
    assert list(rows) == list(FORMATS)
    assert rows["Q4_K"]["pair_bytes"] == 3 * 7168 * 2048 // 256 * 144
    assert rows["bf16"]["pair_bytes"] == 3 * 7168 * 2048 * 2
    assert all(len(r["coverage"]) == 3 for r in out["formats"])
    c = parse_config({**DEEPSEEK_V3_CONFIG, "moe_intermediate_size": 1408})
    assert pair_bytes(c, "Q4_K") is None and pair_bytes(c, "Q8_0") is not None
    plan = config_plan(c, 1024, 700)
    assert all(r["pair_bytes"] is None or len(r["coverage"]) == 1
               for r in plan.rows([48 << 30]))
    assert plan_main(["--config", str(path), "--kv-tokens", "4096"]) == 0
    text = capsys.readouterr().out
    assert "14848 pairs" in text and "| Q4_K | 23.625 MiB |" in text


GPT_OSS_120B_CONFIG = {  # openai/gpt-oss-120b's config.json (its tensors are MXFP4)
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
    "num_experts_per_tok": 4, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "num_local_experts": 128, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {
        "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
        "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
    "swiglu_limit": 7.0, "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0",
    "use_cache": True, "vocab_size": 201088}


def test_gpt_oss_120b_plans_its_mxfp4_experts_with_their_biases(tmp_path, capsys):
    """gpt-oss-120b: 36 x 128 pairs; an MXFP4 pair is 3 x 2880 x 2880 weights in 17-byte
    blocks of 32 plus its fp32 biases (2 x 2880 + 2880); no K-quant holds 2880-wide rows; the
    non-expert weights count the sinks, the o bias and the router bias."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GPT_OSS_120B_CONFIG))
    assert plan_main(["--config", str(path), "--json", "--kv-tokens", "4096"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["format"]: r for r in out["formats"]}
    assert out["pairs"] == 36 * 128
    assert rows["MXFP4"]["pair_bytes"] == 3 * 2880 * 2880 // 32 * 17 + 4 * 3 * 2880
    assert rows["Q4_K"]["pair_bytes"] is None and rows["Q8_0"]["pair_bytes"] is not None
    c = parse_config(GPT_OSS_120B_CONFIG)
    assert c.sliding_layers == tuple(range(0, 36, 2)) and c.window(0) == 128 == 128 + c.window(1)
    attention = 2 * 2880 * 64 * 64 + 2 * 2880 * 8 * 64 + (64 + 16) * 64 + 2880 + 64
    per_layer = attention + 2 * 2880 + 2880 * 128 + 128
    assert non_expert_params(c) == 36 * per_layer + 2 * 201088 * 2880 + 2880


QWEN3_NEXT_80B_CONFIG = {  # Qwen/Qwen3-Next-80B-A3B-Instruct's config.json
    "architectures": ["Qwen3NextForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1,
    "eos_token_id": 151645, "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_value_head_dim": 128,
    "max_position_embeddings": 262144, "mlp_only_layers": [], "model_type": "qwen3_next",
    "moe_intermediate_size": 512, "norm_topk_prob": True, "num_attention_heads": 16,
    "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48,
    "num_key_value_heads": 2, "output_router_logits": False, "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000000,
    "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.57.0.dev0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936}


def test_qwen3_next_plans_its_attention_layers_kv_and_its_linear_state(tmp_path, capsys):
    """Qwen3-Next-80B: 48 x 512 = 24,576 pairs (the reference deployment's count); only its
    12 full-attention layers hold KV (2 heads of 256, K and V: 24 KiB a token in bf16); each
    running sequence carries 36 layers of conv inputs and 32 heads of 128 x 128 fp32 state."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN3_NEXT_80B_CONFIG))
    assert plan_main(["--config", str(path), "--json", "--kv-tokens", "4096"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pairs"] == 24576
    assert out["kv_bytes"] == 4096 * 12 * 2 * 2 * 256 * 2
    assert out["state_bytes_per_sequence"] == 36 * 4 * (3 * (2 * 16 * 128 + 32 * 128)
                                                        + 32 * 128 * 128)
    assert {r["format"]: r for r in out["formats"]}["Q4_K"]["pair_bytes"] == (
        3 * 2048 * 512 // 256 * 144)
    assert plan_main(["--config", str(path)]) == 0
    assert "75.4 MiB of recurrent state per running sequence" in capsys.readouterr().out


QWEN3_5_397B_CONFIG = {  # Qwen/Qwen3.5-397B-A17B: the multimodal config, its text model nested
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
    "tie_word_embeddings": False, "text_config": {
        "model_type": "qwen3_5_moe_text", "attention_bias": False, "attn_output_gate": True,
        "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu",
        "hidden_size": 4096, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 64, "linear_value_head_dim": 128,
        "max_position_embeddings": 262144, "moe_intermediate_size": 1024,
        "mtp_num_hidden_layers": 1, "num_attention_heads": 32, "num_experts": 512,
        "num_experts_per_tok": 10, "num_hidden_layers": 60, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_parameters": {
            "rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
            "mrope_interleaved": True, "mrope_section": [11, 11, 10]},
        "shared_expert_intermediate_size": 1024, "vocab_size": 248320},
    "vision_config": {"model_type": "qwen3_5_moe", "depth": 27, "hidden_size": 1152}}


def test_qwen3_5_397b_plans_from_its_nested_text_config(tmp_path, capsys):
    """Qwen3.5-397B-A17B, the largest Qwen3.5: 60 x 512 = 30,720 pairs, KV only in its 15
    full-attention layers, 45 DeltaNet layers of state per running sequence (64 value heads);
    the vision tower is not planned."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN3_5_397B_CONFIG))
    assert plan_main(["--config", str(path), "--json", "--kv-tokens", "4096"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pairs"] == 60 * 512
    assert out["kv_bytes"] == 4096 * 15 * 2 * 2 * 256 * 2
    assert out["state_bytes_per_sequence"] == 45 * 4 * (3 * (2 * 16 * 128 + 64 * 128)
                                                        + 64 * 128 * 128)
    assert {r["format"]: r for r in out["formats"]}["bf16"]["pair_bytes"] == 3 * 4096 * 1024 * 2


def test_a_bad_config_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**DEEPSEEK_V3_CONFIG, "rope_scaling": {"type": "longrope"}}))
    assert plan_main(["--config", str(path)]) == 2
    assert "longrope" in capsys.readouterr().err


def test_an_fp8_checkpoint_s_attention_is_planned_as_the_engine_holds_it(
        fp8_pair, tmp_path, capsys):  # noqa: F811 - the imported fixture
    """What `--config` saves for an FP8 checkpoint's attention equals what the engine's
    Fp8Matrix q | k | v and o hold against bf16; the published DeepSeek-V3 config's
    quantization_config takes its non-expert weights from 31.9 to 23.1 GiB."""
    from services.bench.config_plan import fp8_weight_bytes
    from services.engine.model.blocks import Fp8Matrix
    from services.engine.runner import ModelRunner
    from tests.engine.test_fp8_checkpoint import BLOCK

    fp8, _ = fp8_pair
    runner = ModelRunner(fp8, cache_slots=0, reserved_bytes=0, dtype="fp32")
    saved = 0
    for layer in runner.model.layers:
        for m in (layer.attn.qkv, layer.attn.o):
            assert isinstance(m, Fp8Matrix)
            saved += 2 * m.codes.numel() - m.nbytes
    assert fp8_weight_bytes(runner.config, BLOCK) == saved
    path = tmp_path / "config.json"
    sizes = {}
    for quant in (True, False):
        raw = dict(DEEPSEEK_V3_CONFIG)
        if not quant:
            raw.pop("quantization_config")
        path.write_text(json.dumps(raw))
        assert plan_main(["--config", str(path), "--json"]) == 0
        sizes[quant] = json.loads(capsys.readouterr().out)["weights_bytes"]
    assert round(sizes[False] / 2**30, 1) == 31.9 and round(sizes[True] / 2**30, 1) == 23.1
