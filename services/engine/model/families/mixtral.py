"""mixtral: Mixtral-8x7B / 8x22B.

GQA without q/k norm, softmax top-K always renormalized; experts under
block_sparse_moe.experts.E.{w1 (gate), w3 (up), w2 (down)}. A sliding window shorter than the
context is refused (no windowed attention yet).
"""

from services.engine.model.config import CheckpointError, WeightNames, req
from services.engine.model.families.base import RawConfig, gqa_family


def config_fields(raw: RawConfig) -> dict:
    window = raw.get("sliding_window")
    if window and window < req(raw, "max_position_embeddings"):
        raise CheckpointError(f"sliding_window={window} is not supported")
    return {"qk_norm": "none", "norm_topk_prob": True}


FAMILY = gqa_family(
    "mixtral", WeightNames(moe="block_sparse_moe", gate="w1", up="w3", down="w2"),
    config_fields)
