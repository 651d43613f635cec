"""gpt_oss: gpt-oss-120b and gpt-oss-20b.

GQA with q/k/v/o biases and a learned attention-sink logit per head (one more term in each
softmax's denominator, weighing no value), sliding-window attention over the last
`sliding_window` positions on the layers `layer_types` marks "sliding_attention" (every other
one), YaRN RoPE. Every layer is MoE: the router's logits carry a bias, the top-K of them are
softmaxed; each expert adds its own biases to its products and applies the clamped SwiGLU
(g = min(gate, limit), u = clamp(up, -limit, limit), g * sigmoid(alpha g) * (u + 1); cache/
formats.py and the kernels take it as ExpertMlp). Experts are stored fused: gate_up_proj
[E, D, 2F] with gate and up columns alternating, down_proj [E, F, D], biases beside them.
"""

from services.engine.model.config import CheckpointError, ModelConfig, WeightNames, req
from services.engine.model.families.base import (
    Family,
    RawConfig,
    Tensors,
    decoder_layer,
    gqa_attention,
)
from services.engine.model.layers.decoder_layer import DecoderLayer

NAMES = WeightNames(router="router", gate_up_interleaved=True)


def config_fields(raw: RawConfig) -> dict:
    layers = req(raw, "num_hidden_layers")
    types = raw.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown or len(types) != layers:
        raise CheckpointError(f"gpt_oss: layer_types must name one of sliding_attention, "
                              f"full_attention for each of the {layers} layers; got {types}")
    return dict(
        qk_norm="none",
        attention_bias=True,
        norm_topk_prob=True,  # softmax over the top-K logits
        attention_sinks=True,
        attention_o_bias=True,
        sliding_window=int(raw.get("sliding_window") or 0),
        sliding_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
        router_logit_bias=True,
        expert_act="clamped",
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
        expert_bias=True,
        moe_intermediate_size=req(raw, "intermediate_size"),
    )


def build_layer(t: Tensors, c: ModelConfig, i: int) -> DecoderLayer:
    attn = gqa_attention(t, c, i, bias=True)
    attn.sinks = t.reader.get(f"model.layers.{i}.self_attn.sinks").float().to(t.device)
    attn.window = c.window(i)
    return decoder_layer(t, c, i, attn, NAMES)


FAMILY = Family("gpt_oss", NAMES, config_fields, build_layer)
