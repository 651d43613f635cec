"""Write a random gpt-oss-shaped GGUF (MXFP4 experts, as llama.cpp's converter lays gpt-oss
out) for side-by-side speed runs of Strata and llama.cpp on the same file.

    python scripts/gpt_oss_gguf.py OUT.gguf [--layers 12] [--experts 32]

The per-layer shape is gpt-oss-20b's (hidden 2880, 64 query / 8 KV heads of 64, experts of
FFN 2880, top-4, sinks, a 128-position window on even layers, vocab 201088); --layers and
--experts scale it (24 and 32: gpt-oss-20b itself; 36 and 128: 120b). Experts are random MXFP4
blocks (E8M0 exponents around 2^-6), the other matrices random BF16 (the released checkpoints'
type; `--dense F16` for the converter's default), norms, biases and the router F32. Tensors are generated and written one at a time (a file larger
than memory streams out). The byte-level vocabulary is padded to the embedding's rows with one
merge (llama.cpp's gpt2 vocabulary requires merges).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import gguf
import numpy as np

D, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 2880, 64, 8, 64, 2880, 201088


def byte_level_alphabet() -> list[str]:
    """GPT-2's byte-level BPE alphabet: the character each byte maps to, by byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b if b in printable else next(extra)) for b in range(256)]


def mxfp4_rows(rng: np.random.Generator, experts: int, rows: int, cols: int) -> np.ndarray:
    """uint8 [E, rows, cols / 32 * 17]: random GGUF MXFP4 blocks (exponent byte first)."""
    blocks = rng.integers(0, 256, size=(experts, rows, cols // 32, 17), dtype=np.uint8)
    blocks[..., 0] = rng.integers(118, 124, size=blocks.shape[:-1], dtype=np.uint8)
    return blocks.reshape(experts, rows, -1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dense", choices=("BF16", "F16"), default="BF16",
                   help="type of the attention matrices, embeddings and lm_head")
    a = p.parse_args()
    rng = np.random.default_rng(a.seed)
    w = gguf.GGUFWriter(str(a.out), "gpt-oss")
    w.add_block_count(a.layers)
    w.add_context_length(4096)
    w.add_embedding_length(D)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_freq_base(150000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(a.experts)
    w.add_expert_used_count(4)
    w.add_expert_feed_forward_length(FFN)
    w.add_sliding_window(128)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_rope_scaling_yarn_beta_fast(32.0)
    w.add_rope_scaling_yarn_beta_slow(1.0)
    byte_tokens = byte_level_alphabet()
    tokens = [*byte_tokens, "<|im_start|>", "<|im_end|>", "<|endoftext|>", "ĠĠ"]
    tokens += [f"<|pad_{i}|>" for i in range(len(tokens), VOCAB)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL] * 3
                      + [gguf.TokenType.NORMAL] + [gguf.TokenType.UNUSED] * (VOCAB - 260))
    w.add_token_merges(["Ġ Ġ"])
    w.add_eos_token_id(257)

    F16, F32, MXFP4 = (gguf.GGMLQuantizationType[a.dense], gguf.GGMLQuantizationType.F32,
                       gguf.GGMLQuantizationType.MXFP4)
    bf16 = a.dense == "BF16"  # written as raw bytes: numpy has no bfloat16
    E = a.experts
    specs: dict[str, tuple[tuple[int, ...], gguf.GGMLQuantizationType]] = {
        "token_embd.weight": ((VOCAB, D), F16), "output.weight": ((VOCAB, D), F16),
        "output_norm.weight": ((D,), F32)}
    for i in range(a.layers):
        b = f"blk.{i}."
        specs.update({
            b + "attn_norm.weight": ((D,), F32), b + "post_attention_norm.weight": ((D,), F32),
            b + "attn_q.weight": ((HEADS * HEAD_DIM, D), F16),
            b + "attn_k.weight": ((KV_HEADS * HEAD_DIM, D), F16),
            b + "attn_v.weight": ((KV_HEADS * HEAD_DIM, D), F16),
            b + "attn_output.weight": ((D, HEADS * HEAD_DIM), F16),
            b + "attn_q.bias": ((HEADS * HEAD_DIM,), F32),
            b + "attn_k.bias": ((KV_HEADS * HEAD_DIM,), F32),
            b + "attn_v.bias": ((KV_HEADS * HEAD_DIM,), F32), b + "attn_output.bias": ((D,), F32),
            b + "attn_sinks.weight": ((HEADS,), F32),
            b + "ffn_gate_inp.weight": ((E, D), F32), b + "ffn_gate_inp.bias": ((E,), F32),
            b + "ffn_gate_exps.weight": ((E, FFN, D // 32 * 17), MXFP4),
            b + "ffn_up_exps.weight": ((E, FFN, D // 32 * 17), MXFP4),
            b + "ffn_down_exps.weight": ((E, D, FFN // 32 * 17), MXFP4),
            b + "ffn_gate_exps.bias": ((E, FFN), F32), b + "ffn_up_exps.bias": ((E, FFN), F32),
            b + "ffn_down_exps.bias": ((E, D), F32)})

    def make(name: str, shape: tuple[int, ...], qtype) -> np.ndarray:
        if qtype == MXFP4:
            return mxfp4_rows(rng, shape[0], shape[1], D if "down" not in name else FFN)
        if name.endswith("norm.weight"):
            return (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        values = rng.standard_normal(shape, dtype=np.float32)
        values *= 0.5 if name.endswith(("sinks.weight", ".bias")) else 0.02
        if qtype == F16 and bf16:  # round to nearest even, as bytes [rows, 2 * cols]
            bits = values.view(np.uint32)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            return bits.astype(np.uint16).view(np.uint8).reshape(*shape[:-1], -1)
        return values.astype(np.float16 if qtype == F16 else np.float32)

    for name, (shape, qtype) in specs.items():
        raw = qtype == MXFP4 or (qtype == F16 and bf16)
        dtype = np.uint8 if raw else (np.float16 if qtype == F16 else np.float32)
        item = 2 if qtype == F16 and bf16 else np.dtype(dtype).itemsize
        byte_shape = (*shape[:-1], shape[-1] * 2) if qtype == F16 and bf16 else shape
        w.add_tensor_info(name, byte_shape, np.dtype(dtype), int(np.prod(shape)) * item,
                          raw_dtype=qtype if raw else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    t0 = time.time()
    for n, (name, (shape, qtype)) in enumerate(specs.items()):
        w.write_tensor_data(make(name, shape, qtype))
        if n % 40 == 0:
            print(f"  {n}/{len(specs)} tensors, {time.time() - t0:.0f} s", flush=True)
    w.close()
    print(f"wrote {a.out} ({a.out.stat().st_size / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
