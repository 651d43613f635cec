"""minimax_m2: MiniMax-M2 and M2.x.

GQA with RMSNorm over the whole q and k projections (the olmoe kind, before the heads are
split), RoPE on each head's first `rotary_dim` dims (the released configs' spelling of
partial_rotary_factor), sigmoid routing: the top-K by score plus a correction bias, weighted by
the scores renormalized, no groups and no scaling; experts and router under Mixtral's names
(block_sparse_moe.experts.E.{w1, w3, w2}), the bias beside the router.
"""

from services.engine.model.config import CheckpointError, WeightNames, req
from services.engine.model.families.base import RawConfig, gqa_family

NAMES = WeightNames(moe="block_sparse_moe", gate="w1", up="w3", down="w2",
                    router_bias="e_score_correction_bias")


def config_fields(raw: RawConfig) -> dict:
    if raw.get("attention_bias") or raw.get("use_routing_bias") is False:
        raise CheckpointError("minimax_m2: attention_bias / use_routing_bias=false are not "
                              "supported")
    fields = dict(
        qk_norm="proj",
        norm_topk_prob=True,
        grouped_routing=True,  # one group: top-K of sigmoid scores + bias
        router_scoring="sigmoid",
    )
    rotary = raw.get("rotary_dim")
    params = raw.get("rope_parameters") or {}
    if rotary and "partial_rotary_factor" not in params and "partial_rotary_factor" not in raw:
        fields["partial_rotary_factor"] = rotary / req(raw, "head_dim")
    return fields


FAMILY = gqa_family("minimax_m2", NAMES, config_fields)
