"""ModelConfig: a Hugging Face MoE config.json parsed into native types.

One forward (model/qwen3_moe.py) runs every supported family; what differs is a few flags here
and the tensor names (WeightNames):
  qwen3_moe  per-head q/k RMSNorm; experts under mlp.experts.E.{gate,up,down}_proj
  mixtral    no q/k norm; top-k renormalized; experts under block_sparse_moe.experts.E.{w1,w3,w2}
  olmoe      q/k RMSNorm over the whole projection, optional clip_qkv
  qwen2_moe  q/k/v bias; a resident shared expert scaled by sigmoid(shared_expert_gate)
  deepseek_v2/_v3  multi-head latent attention (model/deepseek.py), grouped top-k routing (v2
             softmax, v3 sigmoid + score-correction bias) with scaling, ungated shared experts,
             first_k_dense_replace dense layers

Checkpoint writers disagree on spellings (transformers 5 writes `num_local_experts` and a
`rope_parameters` dict; older Qwen3-MoE checkpoints have `num_experts` and `rope_theta`):
both are read here, once, so nothing downstream ever looks at the raw JSON.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class WeightNames:
    """Where a family keeps its MoE tensors: model.layers.L.{moe}.gate (the router) and
    model.layers.L.{moe}.experts.E.{gate,up,down}.weight (the routed experts)."""

    moe: str = "mlp"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    shared: str = "shared_expert"  # the shared expert's block (families that have one)
    shared_gate: str | None = "shared_expert_gate"  # its sigmoid gate (None: ungated)


WEIGHT_NAMES = {
    "qwen3_moe": WeightNames(),
    "mixtral": WeightNames(moe="block_sparse_moe", gate="w1", up="w3", down="w2"),
    "olmoe": WeightNames(),
    "qwen2_moe": WeightNames(),
    "deepseek_v2": WeightNames(shared="shared_experts", shared_gate=None),
    "deepseek_v3": WeightNames(shared="shared_experts", shared_gate=None),
}
SUPPORTED_MODEL_TYPES = tuple(WEIGHT_NAMES)
# q/k RMSNorm: "head" (a [Hd] weight per head), "proj" (over the whole q or k projection), "none"
QK_NORM = {"qwen3_moe": "head", "mixtral": "none", "olmoe": "proj", "qwen2_moe": "none",
           "deepseek_v2": "none", "deepseek_v3": "none"}


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
    # Family flags; fields at their defaults stay out of canonical_json (stable fingerprints).
    qk_norm: str = "head"
    clip_qkv: float | None = None  # olmoe: clamp q, k, v to [-c, c] after the q/k norm
    shared_expert_intermediate_size: int = 0  # qwen2_moe: a dense expert every token runs
    # deepseek routing (grouped_routing): softmax (v2) or sigmoid (v3, + correction bias for
    # the choice) scores, the top topk_groups of num_groups groups, weights times the scaling
    grouped_routing: bool = False
    router_scoring: str = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    # deepseek multi-head latent attention (kv_lora_rank > 0): head_dim is the q/k head dim
    # (nope + rope), K/V cache G = H heads of head_dim with V zero-padded from v_head_dim
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False

    @property
    def weight_names(self) -> WeightNames:
        return WEIGHT_NAMES[self.model_type]

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
        defaults = {f.name: f.default for f in fields(self) if f.default is not MISSING}
        d = {k: v for k, v in asdict(self).items() if k not in defaults or v != defaults[k]}
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

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
        window = raw.get("sliding_window")
        if model_type == "mixtral" and window and window < _req(raw, "max_position_embeddings"):
            raise CheckpointError(f"sliding_window={window} is not supported")
        hidden = _req(raw, "hidden_size")
        heads = _req(raw, "num_attention_heads")
        num_experts = next((raw[k] for k in ("num_local_experts", "num_experts", "n_routed_experts")
                            if raw.get(k) is not None), None)
        if num_experts is None:
            raise CheckpointError("config.json has neither num_local_experts nor num_experts")
        # mixtral and olmoe size their experts with intermediate_size (they have no dense layers)
        moe_ffn = raw.get("moe_intermediate_size") or _req(raw, "intermediate_size")
        renorm = True if model_type == "mixtral" else bool(raw.get("norm_topk_prob", False))
        # qwen2_moe spells q/k/v bias qkv_bias (always on in checkpoints that predate the key)
        bias = raw.get("qkv_bias", True) if model_type == "qwen2_moe" else raw.get("attention_bias")
        values: dict[str, Any] = dict(
            model_type=model_type,
            vocab_size=_req(raw, "vocab_size"),
            hidden_size=hidden,
            num_layers=_req(raw, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            intermediate_size=raw.get("intermediate_size", 0),
            moe_intermediate_size=moe_ffn,
            num_experts=int(num_experts),
            experts_per_token=_req(raw, "num_experts_per_tok"),
            norm_topk_prob=renorm,
            decoder_sparse_step=raw.get("decoder_sparse_step") or 1,
            mlp_only_layers=tuple(sorted(raw.get("mlp_only_layers") or ())),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(raw),
            context_window=_req(raw, "max_position_embeddings"),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(bias),
            qk_norm=QK_NORM[model_type],
            clip_qkv=raw.get("clip_qkv"),
            shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size") or 0,
        )
        if model_type.startswith("deepseek"):
            values.update(_deepseek_fields(raw, moe_ffn))
        return cls(**values)


def _deepseek_fields(raw: dict[str, Any], moe_ffn: int) -> dict[str, Any]:
    nope, rope, v = (_req(raw, k) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    if v > nope + rope:
        raise CheckpointError("v_head_dim above the q/k head dim is not supported")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise CheckpointError("attention_bias / mlp_bias are not supported for deepseek")
    v3 = raw["model_type"] == "deepseek_v3"
    grouped = v3 or raw.get("topk_method", "greedy") == "group_limited_greedy"
    heads = _req(raw, "num_attention_heads")
    return dict(
        head_dim=nope + rope,
        num_kv_heads=heads,  # MLA expands its latent to every head before the K/V cache
        mlp_only_layers=tuple(range(raw.get("first_k_dense_replace") or 0)),
        shared_expert_intermediate_size=(raw.get("n_shared_experts") or 0) * moe_ffn,
        grouped_routing=True,
        router_scoring="sigmoid" if v3 else "softmax",
        norm_topk_prob=v3 and bool(raw.get("norm_topk_prob", True)),  # v2 never renormalizes
        num_groups=(raw.get("n_group") or 1) if grouped else 1,
        topk_groups=(raw.get("topk_group") or 1) if grouped else 1,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        kv_lora_rank=_req(raw, "kv_lora_rank"),
        q_lora_rank=raw.get("q_lora_rank") or 0,
        qk_rope_head_dim=rope,
        v_head_dim=v,
        rope_interleave=bool(raw.get("rope_interleave", True)) or not v3,  # v2: always
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


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names: itself (a *.gguf file) or the only *.gguf of a directory
    without config.json; None for anything else (a Hugging Face checkpoint directory)."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise CheckpointError(f"{path} holds {len(files)} .gguf files; name one of them")
    return files[0] if files else None


def load_model_config(model_dir: Path) -> ModelConfig:
    """config.json of a checkpoint directory, or a GGUF file's metadata (model/gguf_reader.py)."""
    if (gguf_path := find_gguf(model_dir)) is not None:
        from services.engine.model.gguf_reader import load_gguf_config

        return load_gguf_config(gguf_path)
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir} has no config.json")
    return ModelConfig.from_hf(json.loads(path.read_text()))
