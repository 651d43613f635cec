"""deepseek_v2, deepseek_v3, kimi_k2: DeepSeek-V2/V2-Lite, DeepSeek-V3/R1/V3.1 and Kimi-K2
(model_type kimi_k2, DeepSeek-V3's architecture), with the published configs' YaRN
(layers/rope.py, the softmax scale correction on q).

Multi-head latent attention (layers/mla.py), grouped top-K routing (V2 softmax, V3 sigmoid +
score-correction bias) with a scaling factor, ungated shared experts, the first
`first_k_dense_replace` layers dense.
"""

import torch

from services.engine.model.config import CheckpointError, WeightNames, req
from services.engine.model.families.base import Family, RawConfig, Tensors, decoder_layer
from services.engine.model.layers.mla import LatentAttention
from services.engine.model.layers.rope import interleave_perm, softmax_correction

NAMES = WeightNames(shared="shared_experts", shared_gate=None)


def config_fields(raw: RawConfig) -> dict:
    nope, rope, v = (req(raw, k) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    if (raw.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError("partial_rotary_factor is not supported for deepseek (MLA "
                              "rotates its qk_rope_head_dim part)")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise CheckpointError("attention_bias / mlp_bias are not supported for deepseek")
    v3 = raw["model_type"] in ("deepseek_v3", "kimi_k2")
    grouped = v3 or raw.get("topk_method", "greedy") == "group_limited_greedy"
    moe_ffn = raw.get("moe_intermediate_size") or req(raw, "intermediate_size")
    return dict(
        qk_norm="none",
        head_dim=nope + rope,
        num_kv_heads=req(raw, "num_attention_heads"),  # attention's; the pool holds the latent
        mlp_only_layers=tuple(range(raw.get("first_k_dense_replace") or 0)),
        shared_expert_intermediate_size=(raw.get("n_shared_experts") or 0) * moe_ffn,
        grouped_routing=True,
        router_scoring="sigmoid" if v3 else "softmax",
        norm_topk_prob=v3 and bool(raw.get("norm_topk_prob", True)),  # v2 never renormalizes
        num_groups=(raw.get("n_group") or 1) if grouped else 1,
        topk_groups=(raw.get("topk_group") or 1) if grouped else 1,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        kv_lora_rank=req(raw, "kv_lora_rank"),
        q_lora_rank=raw.get("q_lora_rank") or 0,
        qk_rope_head_dim=rope,
        v_head_dim=v,
        rope_interleave=bool(raw.get("rope_interleave", True)) or not v3,  # v2: always
    )


def latent_maps(t: Tensors, c, name: str) -> dict[str, torch.Tensor]:
    """kv_b_proj [H * (Dn + Dv), R] as the absorbed form's per-head maps (layers/mla.py):
    w_uk [H, Dn, R] and w_uv_t [H, R, Dv], in the weight dtype on the device."""
    H, Dn, Dv = c.num_heads, c.head_dim - c.qk_rope_head_dim, c.v_head_dim
    kv_b = t.matrix(name).view(H, Dn + Dv, c.kv_lora_rank)
    return {"w_uk": kv_b[:, :Dn].contiguous(),
            "w_uv_t": kv_b[:, Dn:].transpose(1, 2).contiguous()}


def latent_attention(t: Tensors, c, i: int) -> LatentAttention:
    a = f"model.layers.{i}.self_attn"
    lora = c.q_lora_rank > 0
    return LatentAttention(
        kv_layer=i, num_heads=c.num_heads, head_dim=c.head_dim, rope_dim=c.qk_rope_head_dim,
        v_head_dim=c.v_head_dim, kv_lora_rank=c.kv_lora_rank, eps=c.rms_norm_eps,
        q=None if lora else t.linear(f"{a}.q_proj.weight"),
        q_a=t.get_t(f"{a}.q_a_proj.weight") if lora else None,
        q_a_norm=t.get(f"{a}.q_a_layernorm.weight") if lora else None,
        q_b=t.linear(f"{a}.q_b_proj.weight") if lora else None,
        kv_a=t.get_t(f"{a}.kv_a_proj_with_mqa.weight"),
        kv_a_norm=t.get(f"{a}.kv_a_layernorm.weight"),
        **latent_maps(t, c, f"{a}.kv_b_proj.weight"),
        o=t.linear(f"{a}.o_proj.weight"),
        rope_perm=interleave_perm(c.qk_rope_head_dim) if c.rope_interleave else None,
        softmax_scale=softmax_correction(c.rope_scaling, c.context_window))


def build_layer(t: Tensors, c, i: int):
    return decoder_layer(t, c, i, latent_attention(t, c, i), NAMES)


DEEPSEEK_V2 = Family("deepseek_v2", NAMES, config_fields, build_layer)
DEEPSEEK_V3 = Family("deepseek_v3", NAMES, config_fields, build_layer)
KIMI_K2 = Family("kimi_k2", NAMES, config_fields, build_layer)  # DeepSeek-V3's architecture
