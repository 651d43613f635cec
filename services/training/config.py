"""The training recipe: one frozen dataclass, its derived shapes, and the HF config it becomes."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from services.engine.model.demo import SPECIAL_TOKENS

MODEL_NAME = "strata-stdlib-moe"  # the checkpoint directory's default name

# Token ids of the special tokens: the BPE trainer puts them first, in this order.
SPECIAL_IDS = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
ENDOFTEXT_ID = SPECIAL_IDS["<|endoftext|>"]
IM_END_ID = SPECIAL_IDS["<|im_end|>"]


@dataclass(frozen=True)
class TrainConfig:
    """Defaults are the shipped recipe: ~14M parameters (~28 MB in bf16), 64 experts x 8 layers,
    sized so the full run fits 30 minutes on 2 CPU cores (see the README's budget line)."""

    seed: int = 0
    layers: int = 8
    experts: int = 64
    top_k: int = 8
    hidden: int = 128
    expert_ffn: int = 64
    context: int = 512
    vocab: int = 4096
    batch: int = 8  # sequences per step
    steps: int = 600
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    aux_coef: float = 0.01  # Switch-style load-balancing loss weight
    norm_topk_prob: bool = True
    rope_theta: float = 10000.0
    init_std: float = 0.02
    threads: int = 2
    max_minutes: float | None = None
    eval_tokens: int = 65536  # held-out tokens scored for the card
    corpus_max_bytes: int | None = None  # test/dev knob: read at most this much of each split
    dtype: str = "bfloat16"  # checkpoint weight dtype: bfloat16 | float16

    def __post_init__(self) -> None:
        assert self.hidden % self.head_dim == 0, "hidden must be a multiple of the head dim"
        assert 1 <= self.top_k <= self.experts, "top-k must be in 1..experts"
        assert self.dtype in ("bfloat16", "float16"), self.dtype

    @property
    def head_dim(self) -> int:
        return 32 if self.hidden >= 128 else 16

    @property
    def num_heads(self) -> int:
        return self.hidden // self.head_dim

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.num_heads // 2)  # GQA: two query heads per KV head

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.context

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ParamBudget:
    """Parameter counts of a recipe (vocab = the tokenizer's real size)."""

    total: int
    active_per_token: int  # what one token's forward multiplies by (K of E experts)
    experts: int

    def checkpoint_bytes(self, bytes_per_param: int = 2) -> int:
        return self.total * bytes_per_param

    @property
    def train_flops_per_token(self) -> int:
        return 6 * self.active_per_token  # fwd 2N + bwd 4N, attention scores ignored


def param_budget(cfg: TrainConfig, vocab_size: int) -> ParamBudget:
    D, Hd = cfg.hidden, cfg.head_dim
    attn = D * cfg.num_heads * Hd * 2 + D * cfg.num_kv_heads * Hd * 2 + 2 * Hd
    one_expert = 3 * D * cfg.expert_ffn
    per_layer_dense = attn + D * cfg.experts + 2 * D  # attention, router, two norms
    experts = cfg.layers * cfg.experts * one_expert
    embed_head = 2 * vocab_size * D + D
    total = cfg.layers * per_layer_dense + experts + embed_head
    active = cfg.layers * (per_layer_dense + cfg.top_k * one_expert) + vocab_size * D
    return ParamBudget(total=total, active_per_token=active, experts=experts)


def hf_config(cfg: TrainConfig, vocab_size: int) -> dict[str, Any]:
    """config.json for the trained model. Both expert-count spellings are written: transformers 5
    reads `num_local_experts`, older readers `num_experts`; Strata reads either."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": vocab_size,
        "hidden_size": cfg.hidden,
        "intermediate_size": 4 * cfg.hidden,  # dense-MLP size; unused (no mlp_only_layers)
        "moe_intermediate_size": cfg.expert_ffn,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "num_experts": cfg.experts,
        "num_local_experts": cfg.experts,
        "num_experts_per_tok": cfg.top_k,
        "norm_topk_prob": cfg.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "max_position_embeddings": cfg.context,
        "rms_norm_eps": 1e-6,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": False,
        "attention_bias": False,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "sliding_window": None,
        "router_aux_loss_coef": cfg.aux_coef,
        "output_router_logits": False,
        "bos_token_id": None,
        "eos_token_id": IM_END_ID,
        "pad_token_id": ENDOFTEXT_ID,
        "initializer_range": cfg.init_std,
        "torch_dtype": cfg.dtype,
        "dtype": cfg.dtype,
    }


def format_count(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.{1 if n < 10 * scale else 0}f}{unit}"
    return f"{n:.0f}"


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s"
