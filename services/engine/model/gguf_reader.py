"""Read a llama.cpp GGUF file as if it were a Hugging Face checkpoint.

    model.gguf ─┬─ metadata {arch}.* ──> an HF-style config dict ──> families.parse_config
                ├─ tensors blk.N.* ────> HF names (model.layers.N.*), dequantized to fp32 by
                │                        gguf.quants.dequantize (F32/F16/BF16, Q8_0, K-quants,
                │                        i-quants: whatever gguf-py decodes) as the loader reads it
                └─ tokenizer.ggml.* ───> a `tokenizers` byte-level BPE (gpt2-style vocabularies)

So the one loader (load_qwen3_moe, HostStore) runs GGUF files unchanged: quantized experts
arrive as fp32 and `--expert-dtype int8|int4` requantizes them as it does any checkpoint.
Supported: qwen3moe, qwen2moe, olmoe, gpt-oss, glm4moe, deepseek2 (DeepSeek-V2/V3/R1, Kimi-K2),
minimax-m2 and llama with experts (Mixtral). llama.cpp's converter permutes llama's q/k rows for its
interleaved RoPE; `_unpermute` undoes that. A glm4moe file counts its MTP layer in block_count
(`nextn_predict_layers` of them at the end, not loaded). deepseek2's converter splits MLA's
kv_b_proj per head into attn_k_b (transposed) and attn_v_b: read back as the one kv_b_proj.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.engine.model.blocks import BLOCK_TYPES
from services.engine.model.config import CheckpointError, ModelConfig, WeightNames
from services.engine.model.families import parse_config
from services.engine.model.gguf_header import GGUFHeader

try:
    import gguf
    from gguf.quants import dequantize
except ImportError as e:  # a declared dependency, but say what to do if it is missing
    raise CheckpointError("reading GGUF files needs the `gguf` package: "
                          "pip install 'gguf>=0.16'") from e

log = logging.getLogger("strata.engine")

# general.architecture -> model_type; llama is accepted only with experts (Mixtral)
ARCH_MODEL_TYPE = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "olmoe": "olmoe",
                   "llama": "mixtral", "gpt-oss": "gpt_oss", "glm4moe": "glm4_moe",
                   "deepseek2": "deepseek_v2",  # deepseek2 with sigmoid gating: deepseek_v3
                   "minimax-m2": "minimax_m2"}
# top-k renormalization where the file does not say ({arch}.expert_weights_norm): what
# llama.cpp's graph does for the architecture
DEFAULT_NORM_TOPK = {"qwen3moe": True, "qwen2moe": False, "olmoe": False, "llama": True,
                     "gpt-oss": True, "glm4moe": True, "deepseek2": False, "minimax-m2": True}

LAYER_NAMES = {  # blk.N.<gguf> -> model.layers.N.<hf>; {moe} is the family's MoE block
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",  # gpt-oss's spelling
    "attn_sinks.weight": "self_attn.sinks",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_q_a.weight": "self_attn.q_a_proj.weight",  # deepseek2's latent attention
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",  # older files; newer split it (below)
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "{moe}.{router}.weight",
    "ffn_gate_inp.bias": "{moe}.{router}.bias",
    "exp_probs_b.bias": "{moe}.{router_bias}",  # the choice's correction bias (glm4moe)
    "ffn_gate.weight": "mlp.gate_proj.weight",  # dense layers
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "{moe}.{shared_gate}.weight",
    "ffn_gate_shexp.weight": "{moe}.{shared}.gate_proj.weight",
    "ffn_up_shexp.weight": "{moe}.{shared}.up_proj.weight",
    "ffn_down_shexp.weight": "{moe}.{shared}.down_proj.weight",
}
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
EXPERT_STACKS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
EXPERT_BIASES = ("ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias")  # gpt-oss
# llama.cpp's pre-tokenizer regexes that differ from GPT-2's (tokenizer.ggml.pre)
PRE_TOKENIZER_REGEX = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
             r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


@functools.lru_cache(maxsize=4)
def _open_gguf(path: str, mtime_ns: int) -> GGUFHeader:
    """One parse of a file's header and tensor table for the config, the tokenizer and the
    weights of one load (keyed by modification time: a rewritten file is read again)."""
    return GGUFHeader(path)


class GGUFCheckpoint:
    """CheckpointReader's interface (names, get, shape, expert_weights, fingerprint) over one
    GGUF file, under the Hugging Face names the loader asks for."""

    def __init__(self, path: Path, names: WeightNames | None = None):
        self.path = Path(path)
        try:
            self._reader = _open_gguf(str(self.path), self.path.stat().st_mtime_ns)
        except (ValueError, OSError) as e:
            raise CheckpointError(f"{self.path} is not a readable GGUF file: {e}") from e
        self.arch = str(self.field("general.architecture", ""))
        if self.arch not in ARCH_MODEL_TYPE:
            raise CheckpointError(
                f"unsupported GGUF architecture {self.arch!r} in {self.path.name}: Strata reads "
                f"{', '.join(ARCH_MODEL_TYPE)} (llama only with experts, i.e. Mixtral)")
        if int(self.field("split.count", 1)) > 1:
            raise CheckpointError(f"{self.path.name} is one part of a split GGUF; merge it first "
                                  "(llama-gguf-split --merge)")
        self.weight_names = names or WeightNames()
        self._tensors = {t.name: t for t in self._reader.tensors}
        self._hf = self._name_map()

    def field(self, key: str, default: Any = None) -> Any:
        return self._reader.fields.get(key, default)

    def arch_field(self, key: str, default: Any = None) -> Any:
        return self.field(f"{self.arch}.{key}", default)

    def _name_map(self) -> dict[str, str]:
        n = self.weight_names
        hf = {GLOBAL_NAMES[g]: g for g in self._tensors if g in GLOBAL_NAMES}
        for name in self._tensors:
            parts = name.split(".", 2)
            if parts[0] == "blk" and len(parts) == 3 and parts[2] in LAYER_NAMES:
                target = LAYER_NAMES[parts[2]].format(moe=n.moe, shared=n.shared,
                                                      shared_gate=n.shared_gate, router=n.router,
                                                      router_bias=n.router_bias)
                hf[f"model.layers.{parts[1]}.{target}"] = name
            elif parts[0] == "blk" and len(parts) == 3 and parts[2] == "attn_k_b.weight":
                hf[f"model.layers.{parts[1]}.self_attn.kv_b_proj.weight"] = name  # + attn_v_b
        return hf

    @property
    def names(self) -> list[str]:
        return sorted(self._hf)

    @property
    def num_files(self) -> int:
        return 1

    def __contains__(self, name: str) -> bool:
        return name in self._hf

    def _tensor(self, gguf_name: str) -> Any:
        if gguf_name not in self._tensors:
            raise CheckpointError(f"GGUF {self.path.name} lacks tensor {gguf_name!r}")
        return self._tensors[gguf_name]

    def shape(self, name: str) -> tuple[int, ...]:
        g = self._gguf_name(name)
        if g.endswith(".attn_k_b.weight"):  # [H, R, Dn] and [H, Dv, R] -> [H * (Dn + Dv), R]
            H, R, nope = reversed_shape(self._tensor(g))
            v = reversed_shape(self._tensor(g.replace("attn_k_b", "attn_v_b")))[1]
            return (H * (nope + v), R)
        return tuple(int(d) for d in reversed(self._tensor(g).shape))

    def stored_dtype(self, name: str) -> str:
        """The tensor's GGUF type name (F32, BF16, Q8_0, ...); F32 for one assembled from two
        (deepseek2's kv_b_proj), which is read as floats."""
        g = self._gguf_name(name)
        return "F32" if g.endswith(".attn_k_b.weight") else self._tensor(g).tensor_type.name

    def _gguf_name(self, name: str) -> str:
        if name not in self._hf:
            raise CheckpointError(f"GGUF {self.path.name} has no tensor for {name!r}")
        return self._hf[name]

    def get(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        g = self._gguf_name(name)
        w = self._dequant(self._tensor(g).data, self._tensor(g).tensor_type)
        if g.endswith(".attn_k_b.weight"):  # per head: k_b [R, Dn] transposed, then v_b
            v_b = self._tensor(g.replace("attn_k_b", "attn_v_b"))
            w = torch.cat([w.transpose(1, 2), self._dequant(v_b.data, v_b.tensor_type)], dim=1)
            w = w.reshape(-1, w.shape[-1])  # [H * (Dn + Dv), R]
        if self.arch == "llama" and g.endswith((".attn_q.weight", ".attn_k.weight")):
            heads = self.arch_field("attention.head_count")
            if g.endswith(".attn_k.weight"):
                heads = self.arch_field("attention.head_count_kv", heads)
            w = _unpermute(w, int(heads))
        if name.endswith("shared_expert_gate.weight") and w.ndim == 1:
            w = w[None]  # llama.cpp stores qwen2moe's [1, D] gate as [D]
        return w.to(dtype)

    def expert_weights(
        self, layer: int, expert: int, hidden_size: int, ffn_size: int,
        dtype: torch.dtype = torch.float32,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [F, D], up [F, D], down [D, F]) of one pair, sliced from the stacked
        blk.L.ffn_{gate,up,down}_exps [E, ...] before dequantizing (one expert's blocks)."""
        out = []
        for stack in EXPERT_STACKS:
            t = self._tensor(f"blk.{layer}.{stack}")
            out.append(self._dequant(t.data[expert], t.tensor_type).to(dtype))
        gate, up, down = out
        assert gate.shape == (ffn_size, hidden_size) and down.shape == (hidden_size, ffn_size)
        return gate, up, down

    def expert_biases(self, layer: int, expert: int, hidden_size: int, ffn_size: int
                      ) -> torch.Tensor:
        """One pair's biases, fp32 [gate F | up F | down D] (gpt-oss: blk.L.ffn_*_exps.bias)."""
        parts = [self._dequant(self._tensor(f"blk.{layer}.{b}").data[expert],
                               self._tensor(f"blk.{layer}.{b}").tensor_type)
                 for b in EXPERT_BIASES]
        assert [p.numel() for p in parts] == [ffn_size, ffn_size, hidden_size]
        return torch.cat(parts)

    def expert_storage(self) -> dict[int, tuple[str, str, str]] | None:
        """Each MoE layer's (gate, up, down) expert-stack types when every one is a block type
        Strata computes as stored (model/blocks.py), else None (float stacks, or a type it
        does not: they are read as floats)."""
        types = {}
        for name, t in self._tensors.items():
            if name.endswith(EXPERT_STACKS):
                types.setdefault(int(name.split(".")[1]), {})[name.split(".")[2]] = \
                    t.tensor_type.name
        stacks = {layer: tuple(kinds[s.split(".")[0]] for s in EXPERT_STACKS)
                  for layer, kinds in types.items()}
        if not stacks or any(n not in BLOCK_TYPES for t in stacks.values() for n in t):
            return None
        return stacks  # type: ignore[return-value]

    def fp8(self, name: str) -> None:
        """GGUF has no FP8 type."""
        return None

    def blocks(self, name: str) -> tuple[str, np.ndarray]:
        """(GGUF type, uint8 rows of blocks [out, row bytes]) of a 2-D tensor as stored."""
        t = self._tensor(self._gguf_name(name))
        return t.tensor_type.name, np.asarray(t.data)

    def expert_blocks(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(gate, up, down) of one pair as stored: uint8 rows of blocks (gate/up [F, row
        bytes of D], down [D, row bytes of F]); one expert's slab of each stack, not copied."""
        return tuple(np.asarray(self._tensor(f"blk.{layer}.{stack}").data[expert])
                     for stack in EXPERT_STACKS)  # type: ignore[return-value]

    fp8_block = (128, 128)  # (FP8 scale blocks: safetensors checkpoints only)

    def read_expert_blocks(self, layer: int, expert: int, out: np.ndarray) -> int:
        """Read one pair's (gate, up, down) slabs as stored into `out` (uint8, one after
        another) with positioned reads from the file, not through its mapping: the host store
        holds the only resident copy (the kernel's page cache keeps the file's pages as cache,
        reclaimable, not mapped into this process). Returns the bytes read."""
        at = 0
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for stack in EXPERT_STACKS:
                t = self._tensor(f"blk.{layer}.{stack}")
                slab = int(t.n_bytes) // int(t.data.shape[0])
                view = memoryview(out[at:at + slab])
                got = os.preadv(fd, [view], int(t.data_offset) + expert * slab)
                if got != slab:
                    raise CheckpointError(f"{self.path.name}: short read of {stack} expert "
                                          f"{expert} of layer {layer} ({got} of {slab} bytes)")
                at += slab
        finally:
            os.close(fd)
        return at

    @staticmethod
    def _dequant(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> torch.Tensor:
        try:
            values = dequantize(np.asarray(data), qtype)
        except NotImplementedError as e:
            raise CheckpointError(f"GGUF tensor type {qtype.name} cannot be read: {e}") from e
        return torch.from_numpy(np.array(values, dtype=np.float32))

    def fingerprint(self, config: ModelConfig) -> str:
        """Short hex sha256 over the canonical config and every tensor's name, shape and type."""
        h = hashlib.sha256(config.canonical_json().encode())
        for t in sorted(self._reader.tensors, key=lambda t: t.name):
            h.update(f"\n{t.name}:{[int(d) for d in t.shape]}:{t.tensor_type.name}".encode())
        return h.hexdigest()[:16]

    def hf_config(self) -> dict[str, Any]:
        """The metadata as a config.json dict for families.parse_config."""
        a = self.arch_field
        num_experts = int(a("expert_count", 0) or 0)
        if num_experts == 0:
            raise CheckpointError(f"{self.path.name} ({self.arch}) has no experts: Strata "
                                  "serves Mixture-of-Experts models only")
        heads = int(a("attention.head_count"))
        kv_heads = a("attention.head_count_kv", heads)
        if isinstance(kv_heads, list):
            if len(set(kv_heads)) != 1:
                raise CheckpointError("per-layer KV head counts are not supported")
            kv_heads = kv_heads[0]
        layers = int(a("block_count")) - int(a("nextn_predict_layers", 0) or 0)  # MTP after
        hidden = int(a("embedding_length"))
        moe_layers = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in self._tensors]
        first_moe = moe_layers[0] if moe_layers else 0
        ffn = int(reversed_shape(self._tensor(f"blk.{first_moe}.ffn_gate_exps.weight"))[1])
        scaling = a("rope.scaling.type")
        raw: dict[str, Any] = dict(
            model_type=ARCH_MODEL_TYPE[self.arch],
            vocab_size=int(reversed_shape(self._tensor("token_embd.weight"))[0]),
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(kv_heads),
            head_dim=int(a("attention.key_length", hidden // heads)),
            intermediate_size=int(a("feed_forward_length", ffn) or ffn),
            moe_intermediate_size=ffn,
            num_experts=num_experts,
            num_experts_per_tok=int(a("expert_used_count")),
            norm_topk_prob=bool(a("expert_weights_norm", DEFAULT_NORM_TOPK[self.arch])),
            mlp_only_layers=[i for i in range(layers) if i not in moe_layers],
            rms_norm_eps=_f32(a("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=_f32(a("rope.freq_base", 10000.0)),
            max_position_embeddings=int(a("context_length")),
            tie_word_embeddings="output.weight" not in self._tensors,
            attention_bias="blk.0.attn_q.bias" in self._tensors,
            qkv_bias="blk.0.attn_q.bias" in self._tensors,
            clip_qkv=a("attention.clamp_kqv"),
            sliding_window=a("attention.sliding_window"),
        )
        if scaling not in (None, "none"):
            given = {"factor": a("rope.scaling.factor"),
                     "original_max_position_embeddings": a("rope.scaling.original_context_length"),
                     "beta_fast": a("rope.scaling.yarn_beta_fast"),
                     "beta_slow": a("rope.scaling.yarn_beta_slow")}
            raw["rope_scaling"] = {"rope_type": scaling,
                                   **{k: v for k, v in given.items() if v is not None}}
        if self.arch == "gpt-oss":
            # as every released gpt-oss config.json says (the GGUF keeps neither): YaRN's
            # correction range not rounded to whole dims; sliding-window attention on the even
            # layers (llama.cpp's gpt-oss graph: a window pattern of 2); the activation's
            # alpha 1.702 and limit 7.0 (families/gpt_oss.py's defaults)
            if "rope_scaling" in raw:
                raw["rope_scaling"]["truncate"] = False
            raw["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                                  for i in range(layers)]
        rope_dims = a("rope.dimension_count")
        if self.arch == "deepseek2":
            self._deepseek2(raw, num_experts)
        elif rope_dims is not None and int(rope_dims) != raw["head_dim"]:  # partial RoPE (GLM)
            raw["partial_rotary_factor"] = int(rope_dims) / raw["head_dim"]
        if self.arch == "glm4moe":  # DeepSeek-V3's routing: sigmoid, bias, scale, groups
            raw.update(self._grouped_moe(),
                       use_qk_norm="blk.0.attn_q_norm.weight" in self._tensors)
        if self.arch in ("glm4moe", "minimax-m2") and int(a("expert_gating_func", 2)) != 2:
            raise CheckpointError(f"{self.path.name}: {self.arch} with expert_gating_func "
                                  f"{a('expert_gating_func')} (Strata reads sigmoid, 2)")
        if f"blk.{first_moe}.ffn_up_shexp.weight" in self._tensors:
            raw["shared_expert_intermediate_size"] = int(
                reversed_shape(self._tensor(f"blk.{first_moe}.ffn_up_shexp.weight"))[0])
        if (self.arch != "deepseek2"
                and a("attention.value_length", raw["head_dim"]) != raw["head_dim"]):
            raise CheckpointError("GGUF value_length != key_length is not supported")
        return raw

    def _deepseek2(self, raw: dict[str, Any], num_experts: int) -> None:
        """deepseek2's keys as DeepSeek's config.json fields: MLA's ranks and head dims (the
        file's key/value_length are the latent's, *_mla the heads'), grouped routing (sigmoid
        gating: V3), YaRN's mscale from yarn_log_multiplier (0.1 mscale_all_dim; DeepSeek's
        configs set mscale equal to it)."""
        a = self.arch_field
        rope = int(a("rope.dimension_count"))
        moe = self._grouped_moe()
        raw.update(
            moe,
            model_type="deepseek_v3" if int(a("expert_gating_func", 1)) == 2 else "deepseek_v2",
            n_routed_experts=num_experts, kv_lora_rank=int(a("attention.kv_lora_rank")),
            q_lora_rank=int(a("attention.q_lora_rank", 0) or 0) or None,
            qk_rope_head_dim=rope, qk_nope_head_dim=int(a("attention.key_length_mla")) - rope,
            v_head_dim=int(a("attention.value_length_mla")),
            topk_method="group_limited_greedy" if moe["n_group"] > 1 else "greedy")
        log_mul = a("rope.scaling.yarn_log_multiplier")
        if "rope_scaling" in raw and log_mul:
            mscale = float(f"{log_mul / 0.1:.6g}")  # a float32's digits (0.707, not 0.70699996)
            raw["rope_scaling"].update(mscale=mscale, mscale_all_dim=mscale)

    def _grouped_moe(self) -> dict[str, Any]:
        """glm4moe's and deepseek2's MoE keys as DeepSeek's config fields: leading dense
        layers, shared experts, the routed weights' scale and the expert groups."""
        a = self.arch_field
        return dict(first_k_dense_replace=int(a("leading_dense_block_count", 0) or 0),
                    n_shared_experts=int(a("expert_shared_count", 0) or 0),
                    routed_scaling_factor=_f32(a("expert_weights_scale", 1.0)),
                    n_group=int(a("expert_group_count", 1) or 1),
                    topk_group=int(a("expert_group_used_count", 1) or 1))


def _f32(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.99e-07)."""
    return float(str(np.float32(value)))


def reversed_shape(tensor: Any) -> tuple[int, ...]:
    """A GGUF tensor's shape in torch order (GGUF lists the innermost dimension first)."""
    return tuple(int(d) for d in reversed(tensor.shape))


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's LlamaModel.permute of q/k rows ([H*Hd, ...]: each head's
    rotate-half halves interleaved for ggml's RoPE) back to Hugging Face's order."""
    rows = w.shape[0]
    return (w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def load_gguf_config(path: Path) -> ModelConfig:
    return parse_config(GGUFCheckpoint(path).hf_config())


def gguf_tokenizer(path: Path) -> dict[str, Any]:
    """The tokenizer parts (tokenizers.Tokenizer, bos/eos text, chat template, EOS ids) from
    tokenizer.ggml.*; only gpt2-style byte-level BPE vocabularies (Qwen, OLMoE) are built."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    ck = GGUFCheckpoint(path)
    kind = ck.field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(
            f"GGUF {path.name}: tokenizer model {kind!r} is not supported (Strata builds "
            "gpt2-style byte-level BPE tokenizers from GGUF metadata only)")
    tokens: list[str] = ck.field("tokenizer.ggml.tokens")
    types: list[int] = ck.field("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in ck.field("tokenizer.ggml.merges") or []]
    tok = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    pre = ck.field("tokenizer.ggml.pre", "")
    regex = PRE_TOKENIZER_REGEX.get(pre)
    if regex is None and pre not in ("", "default", "gpt-2"):
        log.warning("GGUF %s: pre-tokenizer %r is split with GPT-2's pattern here (Strata "
                    "reproduces %s only): token ids of some texts (digit runs, CJK, "
                    "punctuation) may differ from llama.cpp's; serve the model's Hugging Face "
                    "directory (tokenizer.json) where that matters", path.name, pre,
                    ", ".join(["gpt-2", *PRE_TOKENIZER_REGEX]))
    if regex is None:  # GPT-2's own split
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    control, user = int(gguf.TokenType.CONTROL), int(gguf.TokenType.USER_DEFINED)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types, strict=True) if k in (control, user)])

    def text(key: str) -> str | None:
        tid = ck.field(f"tokenizer.ggml.{key}")
        return tokens[tid] if tid is not None and 0 <= tid < len(tokens) else None

    eos_ids = {ck.field(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id")}
    return dict(tokenizer=tok, bos_token=text("bos_token_id"), eos_token=text("eos_token_id"),
                chat_template=ck.field("tokenizer.chat_template"),
                eos_token_ids={int(i) for i in eos_ids if i is not None})
