"""`strata plan --config config.json`: what a model needs, from its published config alone.

A 100B-class model's weights are too big to download to find out whether it fits; its
config.json is enough for the arithmetic: the (layer, expert) pairs, the bytes of one pair in
each format Strata holds experts in (the slot size, exactly as the engine's formats compute it),
the non-expert weights (attention, dense layers, shared experts, routers, embeddings, lm_head;
counted from the architecture as the families build it, in bf16, which the GPU backends serve
them in; an FP8 checkpoint's attention in FP8, as the engine keeps it) and the KV cache per
token; then the coverage each device memory size gives.

A format that cannot hold the model's expert rows (a K-quant needs rows of whole 256-weight
super-blocks: GLM-4.5-Air's 1408-wide experts are not) is shown as n/a.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.bench.planner import GIB, MIB, Hardware, plan_row
from services.engine.model.blocks import fp8_kept
from services.engine.model.config import ModelConfig
from services.engine.model.families import weight_names
from services.engine.model.layers.mlp import ExpertMlp
from services.engine.model.paged_kv import PagedKVCache

# format -> what to build it from: the cache formats' own names, or a GGUF block type
FORMATS = ("bf16", "fp8", "int8", "int4", "Q8_0", "Q6_K", "Q5_K", "Q4_K", "IQ4_XS", "MXFP4",
           "Q3_K", "Q2_K")


def pair_bytes(c: ModelConfig, name: str) -> int | None:
    """Bytes of one (layer, expert) pair's blob in format `name`, or None where the format
    cannot hold the expert's rows."""
    from services.engine.cache.formats import BlockFormat, Fp8Format, expert_format

    D, F, mlp = c.hidden_size, c.moe_intermediate_size, ExpertMlp.of(c)  # biases in the blob
    try:
        if name == "bf16":
            return expert_format(D, F, torch.bfloat16, mlp=mlp).blob_bytes
        if name == "fp8":
            return Fp8Format(D, F, mlp=mlp).blob_bytes
        if name in ("int8", "int4"):
            return expert_format(D, F, torch.bfloat16, name, mlp=mlp).blob_bytes
        return BlockFormat(D, F, {0: (name,) * 3}, mlp=mlp).blob_bytes
    except ValueError:  # rows not whole blocks of the type
        return None


def non_expert_params(c: ModelConfig) -> int:
    """Parameters of every tensor the engine loads besides the routed experts, from the
    architecture (equal to the count over a checkpoint's tensors: tests/bench/)."""
    D, H, G, Hd = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    names = weight_names(c)
    if c.kv_lora_rank:  # MLA (deepseek): query latent or not, the KV latent and its rope key
        Rq, R, Dr, Dv = c.q_lora_rank, c.kv_lora_rank, c.qk_rope_head_dim, c.v_head_dim
        q = D * Rq + Rq + Rq * H * Hd if Rq else D * H * Hd
        attention = q + D * (R + Dr) + R + R * H * (Hd - Dr + Dv) + H * Dv * D
    else:
        attention = 2 * D * H * Hd + 2 * D * G * Hd  # q, o; k, v
        attention += D * H * Hd if c.attention_output_gate else 0  # q_proj's gate half
        if c.attention_bias:
            attention += (H + 2 * G) * Hd + (D if c.attention_o_bias else 0)
        attention += H if c.attention_sinks else 0
        attention += {"head": 2 * Hd, "proj": (H + G) * Hd}.get(c.qk_norm, 0)
    per_moe = D * c.num_experts + (c.num_experts if c.router_logit_bias or (
        c.grouped_routing and c.router_scoring == "sigmoid") else 0)
    if c.shared_expert_intermediate_size:
        per_moe += 3 * D * c.shared_expert_intermediate_size
        per_moe += D if names.shared_gate else 0
    moe_layers = len(c.moe_layers)
    dense_layers = c.num_layers - moe_layers
    linear = len(c.linear_layers)  # Gated DeltaNet in place of attention
    layers = ((c.num_layers - linear) * attention + linear * linear_attention_params(c)
              + c.num_layers * 2 * D + moe_layers * per_moe
              + dense_layers * 3 * D * c.intermediate_size)
    vocab = c.vocab_size * D * (1 if c.tie_word_embeddings else 2)
    return layers + vocab + D  # + the final norm


def linear_attention_params(c: ModelConfig) -> int:
    """One Gated DeltaNet layer's parameters (layers/delta_net.py)."""
    D, Hk, Hv = c.hidden_size, c.linear_key_heads, c.linear_value_heads
    Dk, Dv = c.linear_key_head_dim, c.linear_value_head_dim
    channels = 2 * Hk * Dk + Hv * Dv  # q | k | v through the conv
    return (D * (channels + Hv * Dv) + D * 2 * Hv + channels * c.linear_conv_kernel
            + 2 * Hv + Dv + Hv * Dv * D)


def fp8_attention_shapes(c: ModelConfig) -> list[list[tuple[int, int]]]:
    """The [out, in] parts of each layer's attention matrix an FP8 checkpoint may keep as
    stored (families/base.py's Tensors.linear: q | k | v, o; MLA's q or q_b, and o)."""
    D, H, G, Hd = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    if c.kv_lora_rank:
        q = (H * Hd, c.q_lora_rank) if c.q_lora_rank else (H * Hd, D)
        return [[q], [(D, H * c.v_head_dim)]]
    return [[(H * Hd, D), (G * Hd, D), (G * Hd, D)], [(D, H * Hd)]]


def fp8_weight_bytes(c: ModelConfig, block: tuple[int, int]) -> int:
    """What keeping the attention in FP8 saves against bf16 over all layers: 2 bytes a
    weight become one, plus an fp32 scale per block (matrices the engine keeps: fp8_kept)."""
    bo, bi = block
    saved = sum(rows * inputs - 4 * (-(-rows // bo)) * (-(-inputs // bi))
                for parts in fp8_attention_shapes(c) if fp8_kept(parts, block)
                for rows, inputs in parts)
    return saved * c.num_layers


@dataclass(frozen=True)
class ConfigPlan:
    config: ModelConfig
    weight_bytes: int  # non-expert weights, bf16
    kv_bytes: int  # the KV pool for kv_tokens
    kv_tokens: int
    reserved_bytes: int
    fp8_block: tuple[int, int] | None = None  # an FP8 checkpoint's scale blocks

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_bytes // max(self.kv_tokens, 1)

    def rows(self, device_bytes: list[int]) -> list[dict]:
        """Per format: bytes per pair, every pair's host bytes, coverage per device size."""
        out = []
        for name in FORMATS:
            slot = pair_bytes(self.config, name)
            row: dict = {"format": name, "pair_bytes": slot}
            if slot is not None:
                hw = Hardware(slot, self.config.total_pairs, self.reserved_bytes, 0,
                              self.weight_bytes, self.kv_bytes)
                row["host_gib"] = slot * self.config.total_pairs / GIB
                row["coverage"] = [plan_row(hw, b, None, None)["coverage"]
                                   for b in device_bytes]
            out.append(row)
        return out


def config_plan(c: ModelConfig, kv_tokens: int, reserved_mib: float,
                fp8_block: tuple[int, int] | None = None) -> ConfigPlan:
    """The budget terms of a config: bf16 weights (an FP8 checkpoint's attention, fp8_block
    its scale blocks, in FP8 as stored) and a bf16 KV pool for kv_tokens positions (as the
    engine's pool holds them: MLA's latent and rope key, one copy)."""
    block = 16
    per_block = PagedKVCache.model_bytes_per_block(c, block, torch.bfloat16)
    weights = non_expert_params(c) * 2 - (fp8_weight_bytes(c, fp8_block) if fp8_block else 0)
    return ConfigPlan(c, weights, -(-kv_tokens // block) * per_block, kv_tokens,
                      round(reserved_mib * MIB), fp8_block)


def render(plan: ConfigPlan, device_mib: list[float], source: str) -> str:
    c = plan.config
    sizes = ", ".join(f"{m / 1024:g} GiB" for m in device_mib)
    lines = [
        f"{source}: {c.model_type}, {c.num_layers} layers ({len(c.moe_layers)} MoE) x "
        f"{c.num_experts} experts = {c.total_pairs} pairs, {c.experts_per_token} routed per "
        f"token, expert {c.hidden_size} x {c.moe_intermediate_size}",
        f"non-expert weights {plan.weight_bytes / GIB:.2f} GiB "
        f"({'bf16, the attention in FP8 as stored' if plan.fp8_block else 'bf16'}, on the "
        f"device); KV "
        f"{plan.kv_bytes_per_token / 1024:.1f} KiB per token, {plan.kv_bytes / GIB:.2f} GiB "
        f"for {plan.kv_tokens} tokens; {plan.reserved_bytes / MIB:.0f} MiB reserved",
        "",
        f"| format | bytes per pair | all pairs (host) | coverage at {sizes} |",
        "|---|---|---|---|",
    ]
    if c.linear_layers:
        lines.insert(2, f"linear attention on {len(c.linear_layers)} of {c.num_layers} layers "
                        f"(no KV there): {c.linear_state_bytes / MIB:.1f} MiB of recurrent "
                        "state per running sequence, outside the KV pool (the engine budgets "
                        "it for --max-running sequences)")
    for row in plan.rows([round(m * MIB) for m in device_mib]):
        if row["pair_bytes"] is None:
            lines.append(f"| {row['format']} | n/a (rows not whole blocks) | | |")
            continue
        cov = " / ".join(f"{x:.1%}" for x in row["coverage"])
        lines.append(f"| {row['format']} | {row['pair_bytes'] / MIB:.3f} MiB | "
                     f"{row['host_gib']:.1f} GiB | {cov} |")
    if plan.weight_bytes + plan.kv_bytes + plan.reserved_bytes > max(device_mib) * MIB:
        lines.append("")
        lines.append("the non-expert weights, KV and reserve alone exceed the largest size: "
                     "shrink --kv-tokens or serve on a larger device")
    return "\n".join(lines)
