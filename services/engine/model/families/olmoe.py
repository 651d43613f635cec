"""olmoe: OLMoE-1B-7B.

GQA with one q/k RMSNorm over the whole projection (not per head), an optional clip of q, k, v
(`clip_qkv`), softmax top-K; Qwen's tensor names.
"""

from services.engine.model.config import WeightNames
from services.engine.model.families.base import RawConfig, gqa_family


def config_fields(raw: RawConfig) -> dict:
    return {"qk_norm": "proj"}


FAMILY = gqa_family("olmoe", WeightNames(), config_fields)
