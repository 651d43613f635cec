"""ModelConfig: a Hugging Face `qwen3_moe` config.json parsed into native types.

Checkpoint writers disagree on spellings (transformers 5 writes `num_local_experts` and a
`rope_parameters` dict; older Qwen3-MoE checkpoints have `num_experts` and `rope_theta`):
both are read here, once, so nothing downstream ever looks at the raw JSON.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen3_moe",)


class CheckpointError(ValueError):
    """The checkpoint directory is missing something or describes a model Strata cannot run."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense-MLP FFN size (mlp_only_layers / non-sparse layers)
    moe_intermediate_size: int  # one expert's FFN size
    num_experts: int
    experts_per_token: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    rms_norm_eps: float
    rope_theta: float
    context_window: int
    tie_word_embeddings: bool
    attention_bias: bool

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Layers with a sparse MoE block (the others run a dense SwiGLU MLP)."""
        return tuple(layer for layer in range(self.num_layers) if self.is_moe_layer(layer))

    def is_moe_layer(self, layer: int) -> bool:
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def total_pairs(self) -> int:
        """Number of (layer, expert) pairs: every expert of every MoE layer."""
        return len(self.moe_layers) * self.num_experts

    def canonical_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"unsupported model_type {model_type!r}: Strata runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"unsupported hidden_act {raw['hidden_act']!r} (only silu)")
        if raw.get("use_sliding_window"):
            raise CheckpointError("use_sliding_window=true is not supported")
        hidden = _req(raw, "hidden_size")
        heads = _req(raw, "num_attention_heads")
        num_experts = raw.get("num_local_experts", raw.get("num_experts"))
        if num_experts is None:
            raise CheckpointError("config.json has neither num_local_experts nor num_experts")
        return cls(
            model_type=model_type,
            vocab_size=_req(raw, "vocab_size"),
            hidden_size=hidden,
            num_layers=_req(raw, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            intermediate_size=raw.get("intermediate_size", 0),
            moe_intermediate_size=_req(raw, "moe_intermediate_size"),
            num_experts=int(num_experts),
            experts_per_token=_req(raw, "num_experts_per_tok"),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            decoder_sparse_step=raw.get("decoder_sparse_step") or 1,
            mlp_only_layers=tuple(sorted(raw.get("mlp_only_layers") or ())),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(raw),
            context_window=_req(raw, "max_position_embeddings"),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
        )


def _req(raw: dict[str, Any], key: str) -> Any:
    if key not in raw:
        raise CheckpointError(f"config.json lacks {key!r}")
    return raw[key]


def _rope_theta(raw: dict[str, Any]) -> float:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(f"unsupported rope_type {rope_type!r} (only default RoPE)")
    theta = params.get("rope_theta", raw.get("rope_theta"))
    return float(theta if theta is not None else 10000.0)


def load_model_config(model_dir: Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir} has no config.json")
    return ModelConfig.from_hf(json.loads(path.read_text()))
