"""glm4_moe: GLM-4.5 and GLM-4.5-Air, GLM-4.6, GLM-4.7.

GQA with q/k/v biases (`attention_bias`; o has none) and optional per-head q/k norms
(`use_qk_norm`), RoPE on the first partial_rotary_factor (0.5) of each head, DeepSeek-V3's
routing (sigmoid scores, a correction bias for the choice only, the best topk_group of n_group
groups, weights renormalized and times routed_scaling_factor), ungated shared experts, the
first `first_k_dense_replace` layers dense. The checkpoint's multi-token-prediction layer
(`num_nextn_predict_layers`, stored as the layer after the last) is not part of the model: with
`--spec-method mtp` it is the draft source (spec/checkpoint_mtp.py).
"""

from services.engine.model.config import WeightNames, req
from services.engine.model.families.base import RawConfig, gqa_family

NAMES = WeightNames(shared="shared_experts", shared_gate=None)


def config_fields(raw: RawConfig) -> dict:
    return dict(
        qk_norm="head" if raw.get("use_qk_norm") else "none",
        attention_bias=bool(raw.get("attention_bias")),
        mlp_only_layers=tuple(range(raw.get("first_k_dense_replace") or 0)),
        shared_expert_intermediate_size=(raw.get("n_shared_experts") or 0)
        * req(raw, "moe_intermediate_size"),
        grouped_routing=True,
        router_scoring="sigmoid",
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        num_groups=raw.get("n_group") or 1,
        topk_groups=raw.get("topk_group") or 1,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
    )


FAMILY = gqa_family("glm4_moe", NAMES, config_fields)
