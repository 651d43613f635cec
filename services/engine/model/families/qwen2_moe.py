"""qwen2_moe: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B.

GQA with q/k/v biases (spelled `qkv_bias`, on in checkpoints that predate the key), no q/k
norm, softmax top-K, and a resident shared expert scaled by sigmoid(shared_expert_gate(h)).
"""

from services.engine.model.config import WeightNames
from services.engine.model.families.base import RawConfig, gqa_family


def config_fields(raw: RawConfig) -> dict:
    return {"qk_norm": "none", "attention_bias": bool(raw.get("qkv_bias", True))}


FAMILY = gqa_family("qwen2_moe", WeightNames(), config_fields)
