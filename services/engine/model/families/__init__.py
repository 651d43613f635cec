"""Model families, one file each, registered by `model_type`.

    families/qwen3_moe.py  mixtral.py  olmoe.py  qwen2_moe.py  deepseek.py (v2, v3, kimi_k2)  glm4_moe.py
    minimax_m2.py  gpt_oss.py  qwen3_next.py (and qwen3_5_moe)

A family says how its config.json maps to ModelConfig, where its tensors are (WeightNames)
and what its layers are (base.Family). A new family is a new file here plus its line in
FAMILIES; the decoder, the backends, the cache and the planner need nothing else.
"""

from typing import Any

from services.engine.model.config import (
    CheckpointError,
    ModelConfig,
    WeightNames,
    common_fields,
)
from services.engine.model.families import (
    deepseek,
    glm4_moe,
    gpt_oss,
    minimax_m2,
    mixtral,
    olmoe,
    qwen2_moe,
    qwen3_moe,
    qwen3_next,
)
from services.engine.model.families.base import Family

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    qwen3_moe.FAMILY, mixtral.FAMILY, olmoe.FAMILY, qwen2_moe.FAMILY, deepseek.DEEPSEEK_V2,
    deepseek.DEEPSEEK_V3, deepseek.KIMI_K2, glm4_moe.FAMILY, minimax_m2.FAMILY,
    gpt_oss.FAMILY, qwen3_next.FAMILY, qwen3_next.QWEN3_5_MOE, qwen3_next.QWEN3_5_MOE_TEXT)}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def family(model_type: str | None) -> Family:
    """The family of a model_type, or a CheckpointError listing the supported ones."""
    if model_type not in FAMILIES:
        raise CheckpointError(
            f"unsupported model_type {model_type!r}: Strata runs {', '.join(FAMILIES)}")
    return FAMILIES[model_type]


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    """A config.json dict (or a GGUF file's metadata as one) -> ModelConfig: the common fields,
    then the family's own."""
    if isinstance(raw.get("text_config"), dict):  # a multimodal model: its language model
        text = raw["text_config"]
        raw = {**text, "model_type": raw["model_type"],
               "tie_word_embeddings": raw.get("tie_word_embeddings",
                                              text.get("tie_word_embeddings", False))}
    fam = family(raw.get("model_type"))
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"unsupported hidden_act {raw['hidden_act']!r} (only silu)")
    if raw.get("use_sliding_window"):
        raise CheckpointError("use_sliding_window=true is not supported")
    return ModelConfig(**{**common_fields(raw), **fam.config_fields(raw)})


def weight_names(config: ModelConfig) -> WeightNames:
    """Where the config's family keeps its MoE tensors."""
    return family(config.model_type).weight_names
