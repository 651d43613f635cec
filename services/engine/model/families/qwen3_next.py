"""qwen3_next: Qwen3-Next-80B-A3B (the reference deployment's shape: 48 layers x 512 experts,
10 routed + 1 shared); qwen3_5_moe: Qwen3.5's MoE models (35B-A3B to 397B-A17B), the same
architecture with the DeltaNet's projections stored flat (in_proj_qkv, in_proj_z, in_proj_b,
in_proj_a) and every layer MoE (the language model of a Qwen3.5 checkpoint; its vision tower is
not loaded).

Three of every four layers are Gated DeltaNet linear attention (layers/delta_net.py: a
recurrent state per sequence, no K/V); the rest are GQA with per-head q/k norms, RoPE on the
first partial_rotary_factor (0.25) of each 256-dim head, and a sigmoid output gate (q_proj
yields each head's query and gate, re-laid at load as q | k | v | gate). Every RMSNorm but the
DeltaNet's gated one scales by (1 + w): the weights are offset by one at load. MoE layers are
qwen2_moe's: softmax top-K (renormalized), a shared expert behind a sigmoid gate. The
checkpoint's multi-token-prediction layer (`mtp.*`) is not part of the model: with
`--spec-method mtp` it is the draft source (spec/checkpoint_mtp.py, built by build_layer too).
"""

import torch

from services.engine.model.config import CheckpointError, ModelConfig, WeightNames, req
from services.engine.model.families.base import (
    Family,
    RawConfig,
    Tensors,
    gqa_attention,
    moe_block,
)
from services.engine.model.layers.decoder_layer import DecoderLayer
from services.engine.model.layers.delta_net import GatedDeltaNet

NAMES = WeightNames()


def config_fields(raw: RawConfig) -> dict:
    layers = req(raw, "num_hidden_layers")
    types = raw.get("layer_types") or [
        "full_attention" if (i + 1) % (raw.get("full_attention_interval") or 4) == 0
        else "linear_attention" for i in range(layers)]
    if set(types) - {"linear_attention", "full_attention"} or len(types) != layers:
        raise CheckpointError(f"qwen3_next: layer_types must name linear_attention or "
                              f"full_attention for each of the {layers} layers; got {types}")
    if raw.get("attention_bias"):
        raise CheckpointError("qwen3_next: attention_bias is not supported")
    return dict(
        qk_norm="head",
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        linear_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        linear_key_heads=req(raw, "linear_num_key_heads"),
        linear_value_heads=req(raw, "linear_num_value_heads"),
        linear_key_head_dim=req(raw, "linear_key_head_dim"),
        linear_value_head_dim=req(raw, "linear_value_head_dim"),
        linear_conv_kernel=raw.get("linear_conv_kernel_dim") or 4,
        attention_output_gate=True,
        norm_offset=True,
    )


def norm(t: Tensors, name: str) -> torch.Tensor:
    """A (1 + w) RMSNorm weight as a plain one."""
    return t.get(name) + 1


def delta_net(t: Tensors, c: ModelConfig, i: int) -> GatedDeltaNet:
    p = f"model.layers.{i}.linear_attn"
    Hk, Hv, Dk, Dv = (c.linear_key_heads, c.linear_value_heads, c.linear_key_head_dim,
                      c.linear_value_head_dim)
    r = Hv // Hk  # value heads per key head
    if f"{p}.in_proj_qkv.weight" in t:  # Qwen3.5: stored flat, in the order used
        qkvz = torch.cat([t.reader.get(f"{p}.in_proj_{n}.weight", t.dtype) for n in ("qkv", "z")])
        ba = torch.cat([t.reader.get(f"{p}.in_proj_{n}.weight", t.dtype) for n in ("b", "a")])
    else:  # Qwen3-Next: grouped per key head (q, k, v, z rows; b, a rows): re-laid flat
        w = t.reader.get(f"{p}.in_proj_qkvz.weight", t.dtype)
        q, k, v, z = w.view(Hk, -1, c.hidden_size).split([Dk, Dk, r * Dv, r * Dv], dim=1)
        qkvz = torch.cat([part.reshape(-1, c.hidden_size) for part in (q, k, v, z)])
        b, a = t.reader.get(f"{p}.in_proj_ba.weight", t.dtype).view(Hk, 2 * r, -1).split(
            [r, r], 1)
        ba = torch.cat([b.reshape(-1, c.hidden_size), a.reshape(-1, c.hidden_size)])
    conv = t.reader.get(f"{p}.conv1d.weight")[:, 0, :].t().contiguous()  # [Kc, C] fp32
    return GatedDeltaNet(
        qkvz=qkvz.to(t.device), ba=ba.to(t.device),  # torch.cat's: contiguous
        conv=conv.to(t.device), decay=-t.reader.get(f"{p}.A_log").exp().to(t.device),
        dt_bias=t.reader.get(f"{p}.dt_bias").to(t.device), norm=t.get(f"{p}.norm.weight"),
        out=t.rows(f"{p}.out_proj.weight"), key_heads=Hk, value_heads=Hv, key_dim=Dk,
        value_dim=Dv, eps=c.rms_norm_eps)


def gated_attention(t: Tensors, c: ModelConfig, i: int):
    """GQA whose q_proj holds each head's query then its output gate: qkv re-laid as
    q | k | v | gate, the q/k norms offset."""
    a = f"model.layers.{i}.self_attn"
    H, Hd = c.num_heads, c.head_dim
    q, gate = t.reader.get(f"{a}.q_proj.weight", t.dtype).view(H, 2, Hd, -1).unbind(1)
    rows = [q.reshape(H * Hd, -1), t.reader.get(f"{a}.k_proj.weight", t.dtype),
            t.reader.get(f"{a}.v_proj.weight", t.dtype), gate.reshape(H * Hd, -1)]
    attn = gqa_attention(t, c, i, qkv=torch.cat(rows).to(t.device))
    attn.q_norm, attn.k_norm = attn.q_norm + 1, attn.k_norm + 1  # type: ignore[operator]
    attn.output_gate = True
    return attn


def build_layer(t: Tensors, c: ModelConfig, i: int) -> DecoderLayer:
    p = f"model.layers.{i}"
    attn = delta_net(t, c, i) if i in c.linear_layers else gated_attention(t, c, i)
    mlp = moe_block(t, c, i, NAMES) if c.is_moe_layer(i) else t.swiglu(f"{p}.mlp")
    return DecoderLayer(i, norm(t, f"{p}.input_layernorm.weight"),
                        norm(t, f"{p}.post_attention_layernorm.weight"), attn, mlp,
                        c.rms_norm_eps)


def qwen3_5_config_fields(raw: RawConfig) -> dict:
    """Qwen3.5's text config: qwen3_next's, routing always renormalized, every layer MoE."""
    return {**config_fields(raw), "norm_topk_prob": True, "mlp_only_layers": (),
            "decoder_sparse_step": 1}


FAMILY = Family("qwen3_next", NAMES, config_fields, build_layer)
QWEN3_5_MOE = Family("qwen3_5_moe", NAMES, qwen3_5_config_fields, build_layer)
QWEN3_5_MOE_TEXT = Family("qwen3_5_moe_text", NAMES, qwen3_5_config_fields, build_layer)
