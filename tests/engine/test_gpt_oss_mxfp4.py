"""gpt-oss as OpenAI releases it: experts in MXFP4 blocks (`*_proj_blocks`, `*_proj_scales`),
held as stored (re-laid once into GGUF's MXFP4 block, bit for bit) and computed on by the
kernels; checked against transformers running the weights its own MXFP4 dequantization
(integrations/mxfp4.py's convert_moe_packed_tensors) gives."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from services.engine.cache.formats import BlockFormat  # noqa: E402
from services.engine.model.blocks import dequantize, mxfp4_from_openai  # noqa: E402
from services.engine.runner import ModelRunner, slot_bytes_of  # noqa: E402
from tests.engine.test_model_families import make_family_checkpoint  # noqa: E402
from tests.engine.test_model_reference import assert_matches_reference  # noqa: E402

FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)


def openai_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows w [..., R, K] -> OpenAI's MXFP4 (blocks uint8 [..., R, K / 32, 16], scales
    [..., R, K / 32]): a power-of-two scale per 32 weights, each weight its nearest FP4 value,
    weight 2j in byte j's low nibble."""
    b = w.reshape(*w.shape[:-1], -1, 32)
    amax = np.abs(b).max(axis=-1)
    e = np.clip(np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), -127, 127).astype(np.int32)
    q = np.abs(b[..., None] / np.exp2(e)[..., None, None] - FP4).argmin(axis=-1)
    q = q.astype(np.uint8)
    return (np.ascontiguousarray(q[..., 0::2] | (q[..., 1::2] << 4)),
            np.ascontiguousarray((e + 127).astype(np.uint8)))


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    """A tiny random gpt_oss (F 32: whole MXFP4 blocks) written as the released checkpoints
    are, and transformers' model on the weights its own dequantization of those blocks gives."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    model_dir, ref = make_family_checkpoint(path, "gpt_oss", seed=4, intermediate_size=32)
    tensors = load_file(model_dir / "model.safetensors")
    for i, layer in enumerate(ref.model.layers):
        experts = layer.mlp.experts
        for name, rows in (("gate_up_proj", experts.gate_up_proj.transpose(1, 2)),
                           ("down_proj", experts.down_proj.transpose(1, 2))):
            blocks, scales = openai_mxfp4(rows.detach().numpy())  # [E, out, in / 32, ...]
            stem = f"model.layers.{i}.mlp.experts.{name}"
            del tensors[stem]
            tensors[f"{stem}_blocks"] = torch.from_numpy(blocks)
            tensors[f"{stem}_scales"] = torch.from_numpy(scales)
            values = convert_moe_packed_tensors(torch.from_numpy(blocks),
                                                torch.from_numpy(scales), dtype=torch.float32)
            getattr(experts, name).data.copy_(values)  # [E, in, out], as the module holds it
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir, ref


def test_the_relayout_keeps_every_weight():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 96)).astype(np.float32)
    blocks, scales = openai_mxfp4(w)
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    want = convert_moe_packed_tensors(torch.from_numpy(blocks)[None],
                                      torch.from_numpy(scales)[None], dtype=torch.float32)
    got = dequantize(torch.from_numpy(mxfp4_from_openai(blocks, scales)), "MXFP4")
    assert torch.equal(got.view(6, 96), want[0].T)


def test_mxfp4_experts_are_held_as_stored_with_their_biases(mxfp4_checkpoint):
    model_dir, _ = mxfp4_checkpoint
    runner = ModelRunner(model_dir, cache_slots=0, reserved_bytes=0, dtype="fp32")
    fmt = runner.cache.format
    assert isinstance(fmt, BlockFormat) and fmt.kernel_types == ("MXFP4",) * 3
    weights = 3 * 64 * 32 // 32 * 17
    assert fmt.bias_at == -(-weights // 16) * 16
    assert fmt.blob_bytes == slot_bytes_of(model_dir) == fmt.bias_at + 4 * (2 * 32 + 64)


@pytest.mark.parametrize("cpu_kernels", ["off", "auto"])
def test_mxfp4_gpt_oss_matches_transformers_on_its_dequantized_weights(mxfp4_checkpoint,
                                                                       cpu_kernels):
    """Torch ops on the format's reference dequantization: transformers' logits within 1e-4.
    The C kernels round activations to 8 bits per block of 32 (as llama.cpp does): within
    3% of the logits' scale, greedy tokens the same on this prompt."""
    model_dir, ref = mxfp4_checkpoint
    if cpu_kernels == "off":
        assert_matches_reference(model_dir, ref, steps=6, cpu_kernels="off")
    else:
        assert_matches_reference(model_dir, ref, steps=6, atol=0.03, cpu_kernels="auto")


def gguf_blocks(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """OpenAI MXFP4 rows [..., R, n, 16] -> GGUF MXFP4 rows [..., R, n * 17], per the two
    layouts' definitions element by element (the test's own oracle: weight i of a block is
    byte i // 2's low (i even) or high nibble in OpenAI's, byte i % 16's low (i < 16) or high
    nibble in GGUF's, the exponent byte first)."""
    i = np.arange(32)
    w = (blocks[..., i // 2] >> (4 * (i % 2))) & 0x0F  # [..., 32] weight order
    q = w[..., :16] | (w[..., 16:] << 4)
    out = np.concatenate([scales[..., None], q.astype(np.uint8)], axis=-1)
    return out.reshape(*blocks.shape[:-2], -1)


def write_gpt_oss_gguf(model_dir, out) -> None:
    """The MXFP4 checkpoint as llama.cpp's convert_hf_to_gguf writes gpt-oss (its names and
    metadata, checked against the converter; F32 for the rest): gate and up split from the
    interleaved stack, sinks as attn_sinks.weight, the router's bias as ffn_gate_inp.bias."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from tokenizers import Tokenizer as HFTokenizer

    config = json.loads((model_dir / "config.json").read_text())
    t = {k: v.numpy() for k, v in load_file(model_dir / "model.safetensors").items()}
    w = gguf.GGUFWriter(str(out), "gpt-oss")
    rope = config["rope_parameters"]
    for add, value in ((w.add_block_count, config["num_hidden_layers"]),
                       (w.add_context_length, config["max_position_embeddings"]),
                       (w.add_embedding_length, config["hidden_size"]),
                       (w.add_feed_forward_length, config["intermediate_size"]),
                       (w.add_head_count, config["num_attention_heads"]),
                       (w.add_head_count_kv, config["num_key_value_heads"]),
                       (w.add_key_length, config["head_dim"]),
                       (w.add_value_length, config["head_dim"]),
                       (w.add_rope_freq_base, rope["rope_theta"]),
                       (w.add_layer_norm_rms_eps, config["rms_norm_eps"]),
                       (w.add_expert_count, config["num_local_experts"]),
                       (w.add_expert_used_count, config["num_experts_per_tok"]),
                       (w.add_sliding_window, config["sliding_window"]),
                       (w.add_expert_feed_forward_length, config["intermediate_size"]),
                       (w.add_rope_scaling_factor, rope["factor"]),
                       (w.add_rope_scaling_orig_ctx_len, rope["original_max_position_embeddings"]),
                       (w.add_rope_scaling_yarn_beta_fast, rope["beta_fast"]),
                       (w.add_rope_scaling_yarn_beta_slow, rope["beta_slow"])):
        add(value)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    tok = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([tok.id_to_token(i) for i in range(tok.get_vocab_size())])
    w.add_eos_token_id(tok.token_to_id("<|im_end|>"))
    tensors = {"token_embd.weight": t["model.embed_tokens.weight"],
               "output.weight": t["lm_head.weight"], "output_norm.weight": t["model.norm.weight"]}
    names = {"input_layernorm.weight": "attn_norm.weight",
             "post_attention_layernorm.weight": "post_attention_norm.weight",
             "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
             "mlp.router.bias": "ffn_gate_inp.bias"}
    for p in "qkvo":
        for kind in ("weight", "bias"):
            names[f"self_attn.{p}_proj.{kind}"] = f"attn_{'output' if p == 'o' else p}.{kind}"
    for i in range(config["num_hidden_layers"]):
        src = f"model.layers.{i}"
        for hf, g in names.items():
            tensors[f"blk.{i}.{g}"] = t[f"{src}.{hf}"]
        gu = gguf_blocks(t[f"{src}.mlp.experts.gate_up_proj_blocks"],
                         t[f"{src}.mlp.experts.gate_up_proj_scales"])  # [E, 2F, bytes]
        tensors[f"blk.{i}.ffn_gate_exps.weight"] = gu[:, 0::2]
        tensors[f"blk.{i}.ffn_up_exps.weight"] = gu[:, 1::2]
        tensors[f"blk.{i}.ffn_down_exps.weight"] = gguf_blocks(
            t[f"{src}.mlp.experts.down_proj_blocks"], t[f"{src}.mlp.experts.down_proj_scales"])
        bias = t[f"{src}.mlp.experts.gate_up_proj_bias"]
        tensors[f"blk.{i}.ffn_gate_exps.bias"] = bias[:, 0::2]
        tensors[f"blk.{i}.ffn_up_exps.bias"] = bias[:, 1::2]
        tensors[f"blk.{i}.ffn_down_exps.bias"] = t[f"{src}.mlp.experts.down_proj_bias"]
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        w.add_tensor(name, array, raw_dtype=Q.MXFP4 if "_exps.weight" in name else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_the_gguf_llama_cpp_converts_it_to_serves_as_the_safetensors_do(tmp_path_factory):
    """gpt-oss in GGUF (llama.cpp's converter's names, MXFP4 experts, swiglu limit 7 as
    llama.cpp's graph fixes it): the same expert bytes in the host store, the same logits as
    the safetensors checkpoint, bit for bit; its blocks decode (gguf-py) to the values
    transformers' own MXFP4 dequantization gives."""
    from gguf.quants import dequantize as gguf_dequantize
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from services.engine.driver import SequenceDriver

    path = tmp_path_factory.mktemp("gpt-oss-gguf")
    model_dir, ref = make_family_checkpoint(path / "hf", "gpt_oss", seed=5, intermediate_size=32,
                                            swiglu_limit=7.0)
    tensors = load_file(model_dir / "model.safetensors")
    for i in range(3):
        for name in ("gate_up_proj", "down_proj"):
            stem = f"model.layers.{i}.mlp.experts.{name}"
            blocks, scales = openai_mxfp4(tensors.pop(stem).transpose(1, 2).numpy())
            tensors[f"{stem}_blocks"] = torch.from_numpy(blocks)
            tensors[f"{stem}_scales"] = torch.from_numpy(scales)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    gguf_path = path / "gpt-oss.gguf"
    write_gpt_oss_gguf(model_dir, gguf_path)
    import gguf

    stack = next(t for t in gguf.GGUFReader(str(gguf_path)).tensors
                 if t.name == "blk.1.ffn_up_exps.weight")
    want = convert_moe_packed_tensors(tensors["model.layers.1.mlp.experts.gate_up_proj_blocks"],
                                      tensors["model.layers.1.mlp.experts.gate_up_proj_scales"],
                                      dtype=torch.float32)[:, :, 1::2]  # [E, D, F] up
    got = gguf_dequantize(np.asarray(stack.data), gguf.GGMLQuantizationType.MXFP4)
    assert np.array_equal(got.transpose(0, 2, 1), want.numpy())

    runs = {}
    for source in (model_dir, gguf_path):
        runner = ModelRunner(source, cache_slots=0, reserved_bytes=0, dtype="fp32")
        assert runner.cache.format.kernel_types == ("MXFP4",) * 3
        drive = SequenceDriver(runner)
        ids = runner.tokenizer.encode("Routing picks four experts for every token, and")
        seq = drive.start(ids)
        logits = [drive.prefill(seq)]
        for _ in range(4):
            logits.append(drive.decode(seq, int(logits[-1].argmax())))
        runs[source] = (runner.cache.host.blobs.clone(), torch.stack(logits))
    (hf_blobs, hf_logits), (gguf_blobs, gguf_logits) = runs.values()
    assert torch.equal(hf_blobs, gguf_blobs)
    assert torch.equal(hf_logits, gguf_logits)
