"""qwen3_moe: Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-480B.

GQA with a per-head q/k RMSNorm, softmax top-K routing (renormalized where `norm_topk_prob`),
MoE on every `decoder_sparse_step`-th layer except `mlp_only_layers`; experts under
mlp.experts.E.{gate,up,down}_proj.
"""

from services.engine.model.config import WeightNames
from services.engine.model.families.base import RawConfig, gqa_family


def config_fields(raw: RawConfig) -> dict:
    return {"qk_norm": "head"}


FAMILY = gqa_family("qwen3_moe", WeightNames(), config_fields)
