"""ModelConfig: a Hugging Face MoE config.json parsed into native types.

The fields every family shares are read here (common_fields); what a family adds or overrides
(q/k norm kind, biases, shared experts, latent attention, grouped routing) comes from its file
in model/families/, and families.parse_config puts the two together. This module imports
nothing else of the model package. Checkpoint writers disagree on spellings (transformers 5 writes
`num_local_experts` and a `rope_parameters` dict; older Qwen3-MoE checkpoints have
`num_experts` and `rope_theta`): both are read here, once, so nothing downstream ever looks at
the raw JSON.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any


class CheckpointError(ValueError):
    """The checkpoint directory is missing something or describes a model Strata cannot run."""


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
    router_bias: str = "gate.e_score_correction_bias"  # under {moe}: the choice's bias, if any
    router: str = "gate"  # under {moe}: the router's linear layer (gpt_oss: "router")
    gate_up_interleaved: bool = False  # fused gate_up stores [D, 2F], gate and up columns
    # alternating (gpt_oss) instead of [2F, D] gate rows then up rows


def req(raw: dict[str, Any], key: str) -> Any:
    """raw[key], or a CheckpointError naming the missing key."""
    if key not in raw:
        raise CheckpointError(f"config.json lacks {key!r}")
    return raw[key]


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
    rope_scaling: RopeScaling | None = None  # None: default RoPE
    partial_rotary_factor: float = 1.0  # the rotated share of a head (glm4_moe: 0.5)
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
    # (nope + rope); the KV pool holds the latent and the rope key (kv_heads, kv_head_dim)
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # gpt_oss: a learned sink logit per head in every attention softmax; sliding-window
    # attention (the last `sliding_window` positions) on `sliding_layers`; the router's logits
    # biased, top-K then softmax; experts with biases and the clamped SwiGLU (ExpertMlp)
    attention_sinks: bool = False
    attention_o_bias: bool = False  # o_proj has a bias too (attention_bias: q, k, v)
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    router_logit_bias: bool = False
    expert_act: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    expert_bias: bool = False
    # qwen3_next: Gated DeltaNet (linear attention, per-sequence recurrent state, no KV) on
    # `linear_layers`; a sigmoid output gate on the attention layers; (1 + w) RMSNorm weights
    linear_layers: tuple[int, ...] = ()
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    attention_output_gate: bool = False
    norm_offset: bool = False

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """Layers with K/V in the paged pool (not the linear-attention ones), in pool order."""
        return tuple(i for i in range(self.num_layers) if i not in self.linear_layers)

    @property
    def linear_state_bytes(self) -> int:
        """One sequence's recurrent state over every linear-attention layer (fp32: the conv's
        last Kc - 1 inputs and the delta rule's Dk x Dv per value head); 0 without them."""
        channels = (2 * self.linear_key_heads * self.linear_key_head_dim
                    + self.linear_value_heads * self.linear_value_head_dim)
        per_layer = (max(self.linear_conv_kernel - 1, 0) * channels + self.linear_value_heads
                     * self.linear_key_head_dim * self.linear_value_head_dim)
        return 4 * per_layer * len(self.linear_layers)

    @property
    def kv_heads(self) -> int:
        """KV heads the paged pool holds per position: MLA caches one latent 'head'."""
        return 1 if self.kv_lora_rank else self.num_kv_heads

    @property
    def kv_head_dim(self) -> int:
        """Values per pool head: MLA's compressed latent and its rope key (R + Dr)."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.kv_lora_rank else self.head_dim

    @property
    def kv_shared(self) -> bool:
        """K and V are one tensor (MLA: attention reads the latent as both)."""
        return bool(self.kv_lora_rank)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Layers with a sparse MoE block (the others run a dense SwiGLU MLP)."""
        return tuple(layer for layer in range(self.num_layers) if self.is_moe_layer(layer))

    def window(self, layer: int) -> int:
        """Positions layer attends to before its own (0: all of them)."""
        return self.sliding_window if layer in self.sliding_layers else 0

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

def common_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields every family reads the same way (families/ add their own)."""
    hidden = req(raw, "hidden_size")
    heads = req(raw, "num_attention_heads")
    num_experts = next((raw[k] for k in ("num_local_experts", "num_experts", "n_routed_experts")
                        if raw.get(k) is not None), None)
    if num_experts is None:
        raise CheckpointError("config.json has neither num_local_experts nor num_experts")
    theta, scaling, partial = _rope(raw)
    return dict(
        model_type=raw["model_type"],
        vocab_size=req(raw, "vocab_size"),
        hidden_size=hidden,
        num_layers=req(raw, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or hidden // heads,
        intermediate_size=raw.get("intermediate_size", 0),
        # mixtral and olmoe size their experts with intermediate_size (no dense layers)
        moe_intermediate_size=raw.get("moe_intermediate_size") or req(raw, "intermediate_size"),
        num_experts=int(num_experts),
        experts_per_token=req(raw, "num_experts_per_tok"),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        decoder_sparse_step=raw.get("decoder_sparse_step") or 1,
        mlp_only_layers=tuple(sorted(raw.get("mlp_only_layers") or ())),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        partial_rotary_factor=partial,
        context_window=req(raw, "max_position_embeddings"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias")),
        clip_qkv=raw.get("clip_qkv"),
        shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size") or 0,
    )


ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """A config's RoPE scaling (`rope_parameters` / `rope_scaling`, transformers' field names),
    computed by model/layers/rope.py's inv_frequencies. `factor` None (YaRN): DeepSeek's
    max_position_embeddings / original_max_position_embeddings."""

    rope_type: str  # one of ROPE_TYPES, not "default"
    factor: float | None = 1.0
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None  # YaRN: cos and sin scale (else from mscale)
    beta_fast: float = 32.0  # YaRN's correction range, in rotations
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None  # also DeepSeek's softmax scale correction
    truncate: bool = True
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0


def _rope(raw: dict[str, Any]) -> tuple[float, RopeScaling | None, float]:
    """(theta, scaling or None, partial rotary factor) of a config.json."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "su":  # transformers' old name
        rope_type = "longrope"
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(f"unsupported rope_type {rope_type!r} (supported: "
                              f"{', '.join(ROPE_TYPES)})")
    theta = params.get("rope_theta", raw.get("rope_theta"))
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor")) or 1.0
    if rope_type == "default":
        scaling = None
    else:
        keys = {f.name for f in fields(RopeScaling)} - {"rope_type"}
        given = {k: params[k] for k in keys if params.get(k) is not None}
        if rope_type in ("linear", "dynamic", "llama3") and "factor" not in given:
            raise CheckpointError(f"rope_type {rope_type!r} without its factor")
        needs = {"yarn": "original_max_position_embeddings",
                 "llama3": "original_max_position_embeddings"}.get(rope_type)
        if needs and needs not in given:
            raise CheckpointError(f"rope_type {rope_type!r} without {needs}")
        if rope_type == "yarn" and "factor" not in params:
            given["factor"] = None
        scaling = RopeScaling(rope_type, **given)
    return float(theta if theta is not None else 10000.0), scaling, float(partial)


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
