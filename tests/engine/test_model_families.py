"""Families beyond qwen3_moe (mixtral, olmoe, qwen2_moe, deepseek_v2/v3, glm4_moe) against
transformers' own classes, in fp32: tiny random checkpoints written with save_pretrained, loaded
by Strata's ModelRunner."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine.core import Engine
from services.engine.model.demo import write_byte_tokenizer
from services.engine.runner import ModelRunner
from tests.engine.conftest import TOKENIZER_VOCAB
from tests.engine.test_batching import request, run_all
from tests.engine.test_model_reference import assert_matches_reference

BASE = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=32,  # mixtral/olmoe: the expert FFN; qwen2_moe: dense layers
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
    max_position_embeddings=256,
)
LINEAR_ATTENTION = dict(  # the Qwen3-Next / Qwen3.5 tiny shape
    num_experts=8, moe_intermediate_size=16, shared_expert_intermediate_size=32, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
    linear_value_head_dim=8, layer_types=["linear_attention", "full_attention",
                                          "linear_attention"],
    eos_token_id=None, bos_token_id=None, pad_token_id=None)
# family -> (transformers config/model class names, config overrides)
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=8)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=8, eos_token_id=None)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=8, moe_intermediate_size=16, shared_expert_intermediate_size=48)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        n_routed_experts=8, moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1,
        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_group=2, topk_group=1, num_experts_per_tok=3,
        routed_scaling_factor=1.5, topk_method="group_limited_greedy")),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        n_routed_experts=8, moe_intermediate_size=16, n_shared_experts=2, first_k_dense_replace=1,
        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        eos_token_id=None, bos_token_id=None)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        n_routed_experts=8, moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1,
        n_group=2, topk_group=1, routed_scaling_factor=1.5, attention_bias=True,
        eos_token_id=None, bos_token_id=None)),  # partial_rotary_factor 0.5: its default
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", dict(
        num_local_experts=8, intermediate_size=16, head_dim=16, rotary_dim=8,
        eos_token_id=None, bos_token_id=None)),
    # sinks, a sliding window of 8 on layers 0 and 2, YaRN, biases everywhere, the clamped
    # SwiGLU (limit 0.5 so the clamps bite on random weights); F 24 != D 64 / 2
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_local_experts=8, intermediate_size=24, head_dim=16, sliding_window=8,
        swiglu_limit=0.5, rope_parameters=dict(
            rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=64, rope_theta=150000.0),
        eos_token_id=None, bos_token_id=None, pad_token_id=None)),
    # Gated DeltaNet on layers 0 and 2 (2 key heads serving 4 value heads), gated attention
    # on layer 1 (RoPE on a quarter of each head), (1 + w) norms, a gated shared expert
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", LINEAR_ATTENTION),
    # Qwen3.5's MoE text model: the same with flat DeltaNet projections, every layer MoE
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", LINEAR_ATTENTION),
}


def make_family_checkpoint(
    path: Path, family: str, seed: int = 0, **overrides
) -> tuple[Path, torch.nn.Module]:
    """save_pretrained() a seeded random model of `family` plus the byte tokenizer."""
    import transformers

    config_cls, model_cls, family_overrides = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**BASE, **family_overrides, **overrides})
    model = getattr(transformers, model_cls)(config).eval()
    for name, buffer in model.named_buffers():  # deepseek_v3 and others initialize it to zeros
        if name.endswith("e_score_correction_bias"):
            buffer.normal_(0.0, 0.05)
    with torch.no_grad():  # gpt_oss initializes these to zeros or near them: make them count
        for name, param in model.named_parameters():
            if name.endswith(("self_attn.sinks", "gate_up_proj_bias", "down_proj_bias")):
                param.normal_(0.0, 0.5)
            if family.startswith("qwen3_") and name.endswith("norm.weight"):  # (1 + w), w = 0
                param.normal_(0.0, 0.2)
    model.save_pretrained(path)
    write_byte_tokenizer(path, context_window=config.max_position_embeddings)
    return path, model


CASES = [
    ("mixtral", {}),  # softmax -> top-2 -> renormalized, no q/k norm
    ("olmoe", {}),  # q/k norm over the whole projection, no renormalization
    ("olmoe", dict(clip_qkv=0.5, norm_topk_prob=True, num_experts_per_tok=3)),
    ("qwen2_moe", {}),  # q/k/v bias, shared expert with its sigmoid gate
    ("qwen2_moe", dict(norm_topk_prob=True, mlp_only_layers=[1], qkv_bias=False)),
    ("qwen2_moe", dict(decoder_sparse_step=2, num_experts_per_tok=1, tie_word_embeddings=True)),
    # MLA with complex (interleaved) RoPE, softmax routing: top-3 within the 1 of 2 groups with
    # the best expert, scaled; then greedy routing over all experts with a low-rank q
    ("deepseek_v2", {}),
    ("deepseek_v2", dict(topk_method="greedy", q_lora_rank=24, num_experts_per_tok=2)),
    # MLA (V head 12 padded to 24), interleaved RoPE, sigmoid routing in 2 of 4 groups + bias
    ("deepseek_v3", {}),
    ("deepseek_v3", dict(q_lora_rank=24, rope_interleave=False, norm_topk_prob=False,
                         num_experts_per_tok=3, n_group=2, topk_group=1)),
    # YaRN as the published checkpoints set it (here over 64 of 256 positions): interpolated
    # frequencies, cos/sin times mscale / mscale_all_dim, the softmax scale times mscale^2
    # partial RoPE (the first half of each 16-dim head), q/k/v biases, sigmoid routing in 1 of
    # 2 groups + bias, scaled, a shared expert, layer 0 dense; then with per-head q/k norms
    ("glm4_moe", {}),
    ("glm4_moe", dict(use_qk_norm=True, norm_topk_prob=False, n_group=1, topk_group=1,
                      num_experts_per_tok=3)),
    # q/k RMSNorm over the whole projections, RoPE on 8 of 16 dims (rotary_dim), sigmoid top-3
    # by score + bias, renormalized
    ("minimax_m2", dict(num_experts_per_tok=3)),
    # sinks, a sliding window of 8 on layers 0 and 2 (the prompt is longer), YaRN without
    # truncation, q/k/v/o and router biases, top-2 then softmax, experts with biases and the
    # clamped SwiGLU; then every layer sliding, top-3
    ("gpt_oss", {}),
    ("gpt_oss", dict(layer_types=["sliding_attention"] * 3, num_experts_per_tok=3,
                     sliding_window=4)),
    # linear attention with the conv and delta-rule state carried from prefill into decode,
    # gated attention, (1 + w) norms, a gated shared expert; then a dense layer, 4 value heads
    # per key head, top-3
    ("qwen3_next", {}),
    ("qwen3_next", dict(layer_types=["full_attention", "linear_attention", "linear_attention"],
                        mlp_only_layers=[1], linear_num_key_heads=1, num_experts_per_tok=3)),
    ("qwen3_5_moe", {}),
    ("deepseek_v2", dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
        beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707))),
    ("deepseek_v3", dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
        beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0))),
]


@pytest.mark.parametrize(("family", "overrides"), CASES,
                         ids=[f"{f}-{'-'.join(o) or 'default'}" for f, o in CASES])
def test_family_matches_transformers(tmp_path, family, overrides):
    model_dir, ref = make_family_checkpoint(tmp_path / family, family, **overrides)
    assert_matches_reference(model_dir, ref, steps=8)


def test_kimi_k2_is_deepseek_v3_s_architecture(tmp_path):
    """Kimi-K2's config says model_type kimi_k2 over DeepSeek-V3's architecture (transformers
    maps it to DeepseekV3): the same checkpoint under that name gives the reference logits."""
    import json

    model_dir, ref = make_family_checkpoint(tmp_path / "k2", "deepseek_v3", seed=4)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))
    assert ModelRunner(model_dir, cache_slots=0, reserved_bytes=0).config.model_type == "kimi_k2"
    assert_matches_reference(model_dir, ref, steps=4)


def test_mla_caches_the_latent_not_per_head_keys_and_values(tmp_path):
    """DeepSeek's KV pool holds one 'head' per position, the latent and the rope key (R + Dr
    = 40 values here, against H * 2 * (Dn + Dr) = 192 expanded), K and V one tensor; int8 KV
    works on it and stays within int8's tolerance of the fp32 pool."""
    from services.engine.driver import SequenceDriver
    from tests.engine.conftest import TOKENIZER_VOCAB
    from tests.engine.test_model_reference import PROMPT

    model_dir, _ = make_family_checkpoint(tmp_path / "v3", "deepseek_v3")
    runner = ModelRunner(model_dir, cache_slots=0, reserved_bytes=0, dtype="fp32")
    c, kv = runner.config, runner.kv
    assert kv.k.shape[-2:] == (1, c.kv_lora_rank + c.qk_rope_head_dim) == (1, 40)
    assert kv.v is kv.k and kv.nbytes == kv.k.numel() * 4
    logits = []
    for kv_dtype in ("auto", "int8"):
        r = ModelRunner(model_dir, cache_slots=0, reserved_bytes=0, dtype="fp32",
                        kv_dtype=kv_dtype)
        drive = SequenceDriver(r)
        seq = drive.start(r.tokenizer.encode(PROMPT))
        row = drive.prefill(seq)
        for _ in range(4):
            row = drive.decode(seq, int(row.argmax()))
        logits.append(row[:TOKENIZER_VOCAB])
    assert (logits[1] - logits[0]).norm() / logits[0].norm() < 0.05


def test_glm4_moe_s_mtp_layer_is_left_out(tmp_path):
    """A GLM-4.5 checkpoint stores its multi-token-prediction layer as layer num_hidden_layers
    (its own attention, routed experts, eh_proj, enorm/hnorm; transformers does not load it):
    the engine loads only the model's layers, the host memory check counts only what it loads,
    and the logits are transformers'."""
    from safetensors.torch import load_file, save_file

    from services.engine.model.checkpoint import open_checkpoint
    from services.engine.model.families import weight_names
    from services.engine.runner import non_expert_bytes

    model_dir, ref = make_family_checkpoint(tmp_path / "glm", "glm4_moe", seed=2)
    (shard,) = model_dir.glob("*.safetensors")
    config = ModelRunner(model_dir, cache_slots=0, reserved_bytes=0).config
    before = non_expert_bytes(open_checkpoint(model_dir, weight_names(config)), torch.float32,
                              config.num_layers)
    tensors = load_file(shard)
    last, mtp = config.num_layers - 1, config.num_layers
    for name, value in list(tensors.items()):  # the last layer's tensors again, as layer 3
        if name.startswith(f"model.layers.{last}."):
            tensors[name.replace(f"layers.{last}.", f"layers.{mtp}.")] = value.clone() * 3
    D = config.hidden_size
    tensors[f"model.layers.{mtp}.eh_proj.weight"] = torch.randn(D, 2 * D)
    tensors[f"model.layers.{mtp}.enorm.weight"] = torch.ones(D)
    save_file(tensors, shard, metadata={"format": "pt"})
    reader = open_checkpoint(model_dir, weight_names(config))
    assert non_expert_bytes(reader, torch.float32, config.num_layers) == before
    assert_matches_reference(model_dir, ref, steps=4)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_engine_at_partial_coverage_matches_full(tmp_path, family):
    model_dir, _ = make_family_checkpoint(tmp_path / family, family, seed=1)
    probe = ModelRunner(model_dir, device_memory_bytes=10**9, reserved_bytes=0)
    assert probe.slots == probe.total_pairs
    tokens = []
    for slots in (probe.total_pairs, probe.total_pairs // 3):
        runner = ModelRunner(model_dir, cache_slots=slots,
                             reserved_bytes=0)
        assert runner.slots == slots
        engine = Engine(runner, max_running=4, max_step_tokens=16)
        engine.start()
        try:
            clients = run_all(engine, [request(p, max_tokens=12) for p in
                                       ("The expert cache holds", "def f(x):\n    return")])
        finally:
            engine.stop()
        tokens.append([c.tokens for c in clients])
        if slots < probe.total_pairs:
            assert any(c.finished.stats.spilled for c in clients) or any(
                c.finished.stats.hits < c.finished.stats.lookups for c in clients)
    assert tokens[0] == tokens[1]


def test_family_flags_leave_qwen3_fingerprints_alone():
    from services.engine.model.families import parse_config
    from tests.engine.conftest import TINY

    config = parse_config({**TINY, "model_type": "qwen3_moe"})
    assert config.qk_norm == "head" and config.shared_expert_intermediate_size == 0
    assert "qk_norm" not in config.canonical_json()  # fields at their defaults are left out


def test_mixtral_sliding_window_is_refused():
    from services.engine.model.config import CheckpointError
    from services.engine.model.families import parse_config

    raw = {**BASE, "model_type": "mixtral", "num_local_experts": 4, "sliding_window": 128}
    with pytest.raises(CheckpointError, match="sliding_window"):
        parse_config(raw)
    assert parse_config({**raw, "sliding_window": None}).norm_topk_prob


@pytest.mark.parametrize(("family", "patch", "message"), [
    ("deepseek_v3", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                          "partial_rotary_factor": 0.5}}, "partial_rotary"),
    ("minimax_m2", {"attention_bias": True}, "attention_bias"),
    ("minimax_m2", {"use_routing_bias": False}, "use_routing_bias"),
])
def test_family_settings_not_computed_are_refused_by_name(family, patch, message):
    import transformers

    from services.engine.model.config import CheckpointError
    from services.engine.model.families import parse_config

    config_cls, _, family_overrides = FAMILIES[family]
    raw = getattr(transformers, config_cls)(**{**BASE, **family_overrides}).to_dict()
    with pytest.raises(CheckpointError, match=message):
        parse_config({**raw, **patch})


@pytest.mark.parametrize(("family", "cpu_kernels"), [
    ("gpt_oss", "auto"), ("gpt_oss", "off"), ("qwen3_next", "auto")])
def test_batched_with_prefix_reuse_matches_transformers(tmp_path, family, cpu_kernels):
    """Prompts shorter and longer than gpt-oss's window decoded together, in chunks of a
    shared step (sinks and the window in every attention path: the C paged kernel, or batched
    SDPA with the sink column), one reusing another's prefix blocks, at a third of the pairs
    cached; each equals transformers' greedy decoding alone (over the tokenizer's ids, as
    Strata samples). qwen3_next's linear-attention state per sequence: the engine turns
    prefix reuse off (a shared prefix's state is not in the KV pool), the rest holds."""
    model_dir, ref = make_family_checkpoint(tmp_path / family, family, seed=2)
    runner = ModelRunner(model_dir, cache_slots=8, reserved_bytes=0, dtype="fp32",
                         cpu_kernels=cpu_kernels)
    shared = "Routing picks four experts for every token, and "
    prompts = ["abc", shared + "then", shared + "so", "The expert cache holds"]
    engine = Engine(runner, max_running=4, max_step_tokens=32)
    engine.start()
    try:
        clients = run_all(engine, [request(p, max_tokens=10) for p in prompts])
    finally:
        engine.stop()
    reused = sum(c.finished.stats.reused_prompt_tokens for c in clients)
    assert reused > 0 if family == "gpt_oss" else reused == 0
    for prompt, client in zip(prompts, clients, strict=True):
        ids = runner.tokenizer.encode(prompt)
        want = []
        for _ in range(10):
            with torch.no_grad():
                logits = ref(torch.tensor([ids + want])).logits[0, -1, :TOKENIZER_VOCAB]
            want.append(int(logits.argmax()))
        assert client.tokens == want, prompt


def test_qwen3_5_moe_multimodal_checkpoint_serves_its_language_model(tmp_path):
    """A Qwen3.5 checkpoint as released (Qwen3_5MoeForConditionalGeneration: the text config
    nested in text_config, the language model under model.language_model.*, a vision tower):
    its language model gives transformers' text logits; the vision tower is not loaded or
    counted."""
    import transformers

    from services.engine.model.checkpoint import load_model_config, open_checkpoint
    from services.engine.model.families import weight_names
    from services.engine.runner import non_expert_bytes

    _, _, text = FAMILIES["qwen3_5_moe"]
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                  out_hidden_size=BASE["hidden_size"], patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, num_position_embeddings=16)
    torch.manual_seed(7)
    config = transformers.Qwen3_5MoeConfig(text_config={**BASE, **text}, vision_config=vision)
    model = transformers.Qwen3_5MoeForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "language_model" in name and name.endswith("norm.weight"):
                param.normal_(0.0, 0.2)
    model.save_pretrained(tmp_path / "q35")
    write_byte_tokenizer(tmp_path / "q35", context_window=BASE["max_position_embeddings"])
    c = load_model_config(tmp_path / "q35")
    assert c.model_type == "qwen3_5_moe" and c.linear_layers == (0, 2)
    reader = open_checkpoint(tmp_path / "q35", weight_names(c))
    assert not any(n.startswith("model.language_model.") for n in reader.names)
    text_params = sum(p.numel() for n, p in model.named_parameters()
                      if "visual" not in n and ".experts." not in n)
    assert non_expert_bytes(reader, torch.float32, c.num_layers) == 4 * text_params
    assert_matches_reference(tmp_path / "q35", model, steps=4)


def test_linear_attention_state_is_budgeted_for_the_running_sequences(tmp_path):
    """The recurrent state of max_running sequences is budgeted with the KV pool: more running
    sequences, fewer expert slots in the same device memory; an engine running more sequences
    than the runner budgeted is refused."""
    from services.engine.model.checkpoint import load_model_config

    model_dir, _ = make_family_checkpoint(tmp_path / "qwen3_next", "qwen3_next")
    config = load_model_config(model_dir)
    per_sequence = config.linear_state_bytes
    assert per_sequence == 4 * 2 * (3 * (2 * 2 * 8 + 4 * 8) + 4 * 8 * 8)  # 2 DeltaNet layers
    probe = ModelRunner(model_dir, max_running=1, cache_slots=1, reserved_bytes=0,
                        kv_memory_bytes=2**16)
    size = probe.cache_size  # room for 22 of the 24 pairs beside one sequence's state:
    budget = dict(device_memory_bytes=size.weight_bytes + size.kv_bytes + 22 * size.slot_bytes,
                  reserved_bytes=0, kv_memory_bytes=2**16)
    few = ModelRunner(model_dir, max_running=1, **budget)
    many = ModelRunner(model_dir, max_running=8, **budget)
    assert many.state_bytes == 8 * per_sequence and few.slots == 22
    assert many.slots == 22 - -(-7 * per_sequence // few.slot_bytes)
    with pytest.raises(ValueError, match="exceeds the 1 sequences"):
        Engine(few, max_running=2)


def test_gpt_oss_experts_requantized_to_int8_keep_their_biases(tmp_path):
    """--expert-dtype int8 on gpt-oss: the int8 blobs end in the experts' fp32 biases, so the
    logits stay within int8's rounding of the fp32 ones (without the biases, N(0, 0.5) each,
    they would not)."""
    from services.engine.driver import SequenceDriver

    model_dir, _ = make_family_checkpoint(tmp_path / "gpt_oss", "gpt_oss", seed=3)
    logits = {}
    for expert_dtype in ("auto", "int8"):
        runner = ModelRunner(model_dir, cache_slots=0, reserved_bytes=0, dtype="fp32",
                             expert_dtype=expert_dtype)
        assert runner.cache.format.bias_at > 0
        drive = SequenceDriver(runner)
        logits[expert_dtype] = drive.prefill(drive.start(runner.tokenizer.encode(
            "Routing picks four experts for every token, and")))[:TOKENIZER_VOCAB]
    err = (logits["int8"] - logits["auto"]).norm() / logits["auto"].norm()
    assert err < 0.02, err
