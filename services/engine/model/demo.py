"""Random-weight `qwen3_moe` checkpoints Strata writes itself: arbitrary shapes for tests and the
`bench` preset for `strata bench engine` (the default model is the trained one in services/models).

Written with safetensors + tokenizers + json only (no transformers), from a fixed seed, so every
machine gets byte-identical weights; it also loads in transformers' Qwen3MoeForCausalLM.
Tokenizer: byte-level, token id == byte value for the 256 byte tokens, then the special tokens.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

DEMO_MODEL_NAME = "strata-demo-moe"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 256, 257, 258
# ChatML, with tools the way Qwen2.5/Qwen3 render them (the "hermes" tool-call syntax: a
# <tool_call> block of {"name", "arguments"} JSON per call, results in <tool_response>).
# Without tools a conversation renders exactly as plain ChatML.
CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first and tools %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message['content'] %}{{- message['content'] + '\\n' }}{%- endif %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- if not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' "
    "+ call['function']['arguments'] + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] "
    "+ '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
DEMO_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 512,  # 256 bytes + 3 special tokens, padded to a round number
    "hidden_size": 256,
    "intermediate_size": 512,  # dense MLP size, used only by mlp_only_layers
    "moe_intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "hidden_act": "silu",
    "use_sliding_window": False,
    "sliding_window": None,
    "bos_token_id": None,
    "eos_token_id": 258,
    "pad_token_id": 256,
    "initializer_range": 0.02,
    "torch_dtype": "float32",
}
# Named config overrides of DEMO_CONFIG. "bench" is the standard shape for `strata bench engine`
# figures: big enough that decode is bound by weight bytes (about 190 MB read per token).
PRESETS: dict[str, dict[str, Any]] = {
    "demo": {},
    "bench": {
        "vocab_size": 32000,
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 256,
        "intermediate_size": 1024,
        "torch_dtype": "float32",
    },
    # Qwen3-30B-A3B's per-layer shape (its published config.json), random bf16 weights: what a
    # user's decode step reads. 12 layers (15.1 GiB) by default; `--layers N` for more or fewer.
    "qwen3-30b-a3b": {
        "vocab_size": 151936,
        "hidden_size": 2048,
        "num_hidden_layers": 12,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "intermediate_size": 6144,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-06,
        "norm_topk_prob": True,
        "torch_dtype": "bfloat16",
    },
}


def strata_home() -> Path:
    return Path(os.environ.get("STRATA_HOME") or Path.home() / ".cache" / "strata")


def demo_model_dir(preset: str = "demo") -> Path:
    """Where `strata model demo` writes a preset's checkpoint unless told otherwise."""
    name = DEMO_MODEL_NAME if preset == "demo" else f"strata-{preset}-moe"
    return strata_home() / "models" / name


def write_demo_checkpoint(
    path: Path, *, seed: int = 0, preset: str = "demo", progress=None, **config_overrides: Any
) -> Path:
    """Write config, random weights (std 0.02, fixed seed), tokenizer files into `path`:
    DEMO_CONFIG, then PRESETS[preset], then config_overrides. Stored in the config's
    torch_dtype; a checkpoint over SHARD_BYTES is written shard by shard (the embeddings and
    lm_head, then one shard per layer, with a safetensors index), so it never has to fit in
    memory at once."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {**DEMO_CONFIG, **PRESETS[preset], **config_overrides}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    dtype = getattr(torch, config.get("torch_dtype", "float32"))
    parts = demo_weight_parts(config, seed)
    if demo_bytes(config, dtype) <= SHARD_BYTES:
        weights = {k: v.to(dtype) for part in parts for k, v in part.items()}
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        num = config["num_hidden_layers"] + 1
        weight_map, total = {}, 0
        for i, part in enumerate(parts):
            name = f"model-{i + 1:05d}-of-{num:05d}.safetensors"
            part = {k: v.to(dtype) for k, v in part.items()}
            save_file(part, str(path / name), metadata={"format": "pt"})
            weight_map |= dict.fromkeys(part, name)
            total += sum(v.numel() * v.element_size() for v in part.values())
            if progress:
                progress(f"demo checkpoint: wrote shard {i + 1}/{num} ({total / 2**30:.2f} GiB)")
        (path / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n")
    write_byte_tokenizer(path, context_window=config["max_position_embeddings"])
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [258, 256], "pad_token_id": 256, "do_sample": False}, indent=2)
        + "\n"
    )
    return path


SHARD_BYTES = 2 * 2**30  # checkpoints larger than this are written shard by shard


def demo_bytes(config: dict[str, Any], dtype: torch.dtype) -> int:
    """Bytes of a demo checkpoint's weights in `dtype` (the sum of demo_weights' shapes)."""
    D, V = config["hidden_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    Hd = config.get("head_dim") or D // heads
    E, Fe, Fd = config["num_experts"], config["moe_intermediate_size"], config["intermediate_size"]
    attention = D * Hd * (2 * heads + 2 * kv_heads) + 2 * D + 2 * Hd
    moe = E * D + E * 3 * D * Fe
    params = (1 if config.get("tie_word_embeddings") else 2) * V * D + D
    params += config["num_hidden_layers"] * (attention + max(moe, 3 * D * Fd))
    return params * torch.empty((), dtype=dtype).element_size()


def demo_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Every weight of a demo checkpoint (fp32), in one dict."""
    return {k: v for part in demo_weight_parts(config, seed) for k, v in part.items()}


def demo_weight_parts(config: dict[str, Any], seed: int) -> Iterator[dict[str, torch.Tensor]]:
    """The weights (fp32) in parts drawn in order from one generator: the embeddings, final
    norm and lm_head, then each layer's."""
    gen = torch.Generator().manual_seed(seed)
    std = config.get("initializer_range", 0.02)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    D, V = config["hidden_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    Hd = config.get("head_dim") or D // heads
    E, Fe, Fd = config["num_experts"], config["moe_intermediate_size"], config["intermediate_size"]
    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": normal(V, D),
        "model.norm.weight": torch.ones(D),
    }
    if not config.get("tie_word_embeddings"):
        lm_head = normal(V, D)
        # Larger rows for printable ASCII so greedy demo output is readable text, not stray
        # UTF-8 continuation bytes or vocab padding (the weights stay random).
        printable = [10, *range(32, 127)]
        lm_head[[t for t in printable if t < V]] *= 4.0
        w["lm_head.weight"] = lm_head
    yield w
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        w = {
            f"{p}.input_layernorm.weight": torch.ones(D),
            f"{p}.post_attention_layernorm.weight": torch.ones(D),
            f"{p}.self_attn.q_proj.weight": normal(heads * Hd, D),
            f"{p}.self_attn.k_proj.weight": normal(kv_heads * Hd, D),
            f"{p}.self_attn.v_proj.weight": normal(kv_heads * Hd, D),
            f"{p}.self_attn.o_proj.weight": normal(D, heads * Hd),
            f"{p}.self_attn.q_norm.weight": torch.ones(Hd),
            f"{p}.self_attn.k_norm.weight": torch.ones(Hd),
        }
        step = config.get("decoder_sparse_step") or 1
        if i in (config.get("mlp_only_layers") or []) or E == 0 or (i + 1) % step:
            w |= {
                f"{p}.mlp.gate_proj.weight": normal(Fd, D),
                f"{p}.mlp.up_proj.weight": normal(Fd, D),
                f"{p}.mlp.down_proj.weight": normal(D, Fd),
            }
            yield w
            continue
        w[f"{p}.mlp.gate.weight"] = normal(E, D)
        for e in range(E):
            w |= {
                f"{p}.mlp.experts.{e}.gate_proj.weight": normal(Fe, D),
                f"{p}.mlp.experts.{e}.up_proj.weight": normal(Fe, D),
                f"{p}.mlp.experts.{e}.down_proj.weight": normal(D, Fe),
            }
        yield w


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE."""
    bs = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def write_byte_tokenizer(path: Path, context_window: int = 4096) -> None:
    """tokenizer.json (byte-level, no merges: id == byte) + tokenizer_config.json (ChatML)."""
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": CHATML_TEMPLATE,
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "model_max_length": context_window,
            },
            indent=2,
        )
        + "\n"
    )
