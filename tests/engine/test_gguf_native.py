"""GGUF tensors kept as stored (#19): the host store, the slots and the link carry the file's
expert bytes, attention and the lm_head stay in their block types, and the CPU kernels compute
on them (tests/engine/test_block_kernels.py checks each type's kernels against the reference).

The stated tolerance: the integer products round activations to 8 bits per value (per block
of 32 or 256, as llama.cpp does), which moves the tiny Q8_0 model's logits by 0.7% of their
rms against the same file dequantized to F32 and run in fp32 (the bound: 2%); top-1 agrees
at 12 of 13 teacher-forced steps (the bound: 10 of 13; a random tiny model has near-ties)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from services.engine.cache.formats import BlockFormat, expert_format  # noqa: E402
from services.engine.model.checkpoint import open_checkpoint  # noqa: E402
from services.engine.model.families import weight_names  # noqa: E402
from services.engine.runner import ModelRunner, slot_bytes_of  # noqa: E402
from tests.engine.test_gguf_import import (  # noqa: E402
    PROMPT,
    greedy_logits,
    quantized,
    source,  # noqa: F401 - the module fixture
    source_tensors,
    write_gguf,
)
from tests.engine.test_runner import greedy, greedy_by_cache_size  # noqa: E402


def test_q8_0_blocks_dequantize_as_gguf_py_does():
    """The format's dequantization equals gguf-py's reference bit for bit, for the three
    matrices of a blob (gate and up: F rows of D; down: D rows of F)."""
    rng = np.random.default_rng(0)
    D, F = 64, 96
    mats = [rng.standard_normal(s).astype(np.float32) * 0.05 for s in ((F, D), (F, D), (D, F))]
    stored = [quantize(m, Q.Q8_0) for m in mats]  # uint8 rows of blocks
    fmt = BlockFormat(D, F, {0: ("Q8_0",) * 3})
    assert fmt.blob_bytes == 3 * F * D // 32 * 34 == sum(s.nbytes for s in stored)
    blob = torch.from_numpy(np.concatenate([s.reshape(-1) for s in stored]))
    for got, raw in zip(fmt.weights(blob, torch.float32), stored, strict=True):
        assert torch.equal(got, torch.from_numpy(dequantize(raw, Q.Q8_0)))
    x = torch.randn(5, D)
    gate, up, down = (torch.from_numpy(dequantize(s, Q.Q8_0)) for s in stored)
    want = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T
    assert torch.equal(fmt.forward(x, blob), want)
    gate_up_t, down_t = fmt.views(blob)  # the logical orientation every format gives
    assert torch.equal(gate_up_t, torch.cat([gate, up]).T) and torch.equal(down_t, down.T)
    with pytest.raises(ValueError, match="IQ2_XXS is not computed as stored"):
        BlockFormat(D, F, {0: ("IQ2_XXS",) * 3})
    with pytest.raises(ValueError, match="whole blocks of 32"):
        BlockFormat(48, F, {0: ("Q8_0",) * 3})
    with pytest.raises(ValueError, match="whole blocks of 256"):
        BlockFormat(D, F, {0: ("Q4_K",) * 3})


def test_layers_stored_in_different_types_share_the_largest_blob():
    """Q4_K_M keeps some layers' down stack in Q6_K: a slot holds the largest layer's pair,
    and each layer's format reads its own types."""
    D, F = 256, 512
    fmt = BlockFormat(D, F, {0: ("Q4_K", "Q4_K", "Q6_K"), 1: ("Q4_K",) * 3})
    q4, q6 = F * D // 256 * 144, F * D // 256 * 210
    assert fmt.blob_bytes == 2 * q4 + q6 and fmt.at(1).blob_bytes == fmt.blob_bytes
    assert fmt.at(0).kernel_types == ("Q4_K", "Q4_K", "Q6_K")
    assert fmt.at(1).kernel_types == ("Q4_K",) * 3
    assert fmt.name == "q4_k+q6_k" and "Q4_K/Q4_K/Q6_K: 1 layer)" in fmt.describe()


@pytest.fixture(scope="module")
def q8_0_gguf(source, tmp_path_factory):  # noqa: F811 - the imported fixture
    ckpt, _ = source
    return write_gguf(ckpt, tmp_path_factory.mktemp("q8") / "tiny-q8_0.gguf",
                      quantized(source_tensors(ckpt), Q.Q8_0))


def test_q8_0_experts_are_held_as_the_file_stores_them(q8_0_gguf):
    """Slots are Q8_0's 8.5 bits per weight, not the bf16 / fp32 of a dequantized expert; the
    host store holds each pair's three slabs of the file byte for byte; `strata plan` and the
    auto-sizer use that size."""
    runner = ModelRunner(q8_0_gguf, cache_slots=6, reserved_bytes=0)
    D, F = runner.config.hidden_size, runner.config.moe_intermediate_size
    assert runner.cache.format.name == "q8_0"
    assert runner.slot_bytes == 3 * D * F // 32 * 34 == slot_bytes_of(q8_0_gguf)
    assert slot_bytes_of(q8_0_gguf, expert_dtype="int8") == expert_format(
        D, F, torch.bfloat16, "int8").blob_bytes  # --expert-dtype still requantizes
    reader = open_checkpoint(q8_0_gguf, weight_names(runner.config))
    assert reader.expert_storage() == {i: ("Q8_0",) * 3 for i in range(runner.config.num_layers)}
    for layer, expert in [(0, 0), (1, 5), (2, 7)]:
        stored = np.concatenate([s.reshape(-1) for s in reader.expert_blocks(layer, expert)])
        assert np.array_equal(runner.cache.host.blob((layer, expert)).numpy(), stored)


def dequantized_file(ckpt, tensors, path):
    """The same tensors with every block type dequantized to F32 (gguf-py's dequantize)."""
    return write_gguf(ckpt, path, {name: ((dequantize(a, q), Q.F32) if q != Q.F32 else (a, q))
                                   for name, (a, q) in tensors.items()})


def test_q8_0_file_computes_what_its_dequantized_weights_do(q8_0_gguf, source, tmp_path):  # noqa: F811
    """Against the reference (every tensor dequantized by gguf-py, an fp32 forward): logits
    within the stated 8-bit-activation tolerance (module docstring)."""
    ckpt, _ = source
    reference = dequantized_file(ckpt, quantized(source_tensors(ckpt), Q.Q8_0),
                                 tmp_path / "tiny-q8_0-dequantized.gguf")
    from services.engine.model.tokenizer import Tokenizer
    from tests.engine.test_gguf_import import reference_path, rel_rms

    ids = Tokenizer(ckpt).encode(PROMPT)
    got_prefill = greedy_logits(q8_0_gguf, ids, steps=0, dtype="fp32")
    want_prefill = greedy_logits(reference, ids, steps=0, dtype="fp32")
    assert rel_rms(got_prefill, want_prefill) <= 0.02
    _, ref_model = source
    ids, _ = reference_path(ref_model, ids, steps=12)
    got = greedy_logits(q8_0_gguf, ids, steps=12, dtype="fp32")
    want = greedy_logits(reference, ids, steps=12, dtype="fp32")
    assert rel_rms(got, want) <= 0.02
    assert (got.argmax(-1) == want.argmax(-1)).sum().item() >= 10


@pytest.mark.parametrize("placement", ["host", "copy"])
def test_q8_0_greedy_output_is_identical_across_cache_sizes(q8_0_gguf, placement):
    results = greedy_by_cache_size(q8_0_gguf, (0, 6, 24), PROMPT, n=10, placement=placement)
    assert all(t == results[0][0] and torch.equal(lg, results[0][1]) for t, lg in results)


def test_a_q8_0_lm_head_is_read_as_stored_by_the_cpu_kernels(q8_0_gguf):
    """The lm_head (the largest matrix of a step) stays Q8_0 where the backend reads blocks:
    strata_linear_blocks equals its reference (dequantize, then the product on the rounded
    activations) to float rounding, a row's logits are the same bits alone or batched, and the
    torch backend, which has no such kernel, gets the dequantized matrix at load and logits
    within the stated tolerance."""
    from services.engine.model.blocks import BlockMatrix, round_activations
    from tests.engine.test_gguf_import import rel_rms

    kernels_on = ModelRunner(q8_0_gguf, cache_slots=6, reserved_bytes=0, cpu_kernels="on")
    head = kernels_on.model.lm_head
    assert isinstance(head, BlockMatrix) and head.data.dtype == torch.uint8
    D, V = kernels_on.config.hidden_size, kernels_on.config.vocab_size
    assert head.segments == (("Q8_0", V),) and head.data.numel() == V * (D // 32 * 34)
    x = torch.randn(5, D)
    got = kernels_on.backend.linear(x, head)
    torch.testing.assert_close(got, round_activations(x, "Q8_0") @ head.dequantize().T,
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.cat([kernels_on.backend.linear(x[i:i + 1].clone(), head)
                                  for i in range(5)]), got)
    torch_ops = ModelRunner(q8_0_gguf, cache_slots=6, reserved_bytes=0, cpu_kernels="off")
    assert isinstance(torch_ops.model.lm_head, torch.Tensor)
    ids = list(range(3, 40))
    on = greedy_logits(q8_0_gguf, ids, steps=0, cpu_kernels="on", dtype="fp32")
    off = greedy_logits(q8_0_gguf, ids, steps=0, cpu_kernels="off", dtype="fp32")
    assert rel_rms(on, off) <= 0.02


def test_q8_0_attention_runs_as_stored_in_the_fused_decode_layer(q8_0_gguf):
    """q/k/v and o stay Q8_0 rows where the CPU kernels run (prefill through
    strata_linear_blocks, decode steps in the fused decode layer); the decode steps' logits equal
    the same positions scored in one prefill step, to float rounding."""
    from services.engine.driver import SequenceDriver
    from services.engine.model.blocks import BlockMatrix

    runner = ModelRunner(q8_0_gguf, cache_slots=24, reserved_bytes=0, cpu_kernels="on")
    attn = runner.model.layers[0].attn
    c = runner.config
    assert isinstance(attn.qkv, BlockMatrix) and isinstance(attn.o, BlockMatrix)
    assert attn.qkv.out_features == (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    assert runner.model.fusable
    seq, tokens, _ = greedy(runner, PROMPT, n=6)
    drive = SequenceDriver(runner)
    decoded = drive.start(seq.token_ids[:seq.prompt_len])
    rows = [drive.prefill(decoded)]
    for token in tokens[:-1]:
        rows.append(drive.decode(decoded, token))
    drive.release(decoded)
    scored = drive.score(seq.token_ids[:seq.prompt_len + len(tokens) - 1])[seq.prompt_len - 1:]
    torch.testing.assert_close(torch.stack(rows), scored, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def q4_k_m_gguf(tmp_path_factory):
    """llama-quantize's Q4_K_M mix on a 256-wide model: every 2-D tensor Q4_K, except attn_v,
    the lm_head and layer 0's down stack in Q6_K (1-D tensors and the router F32)."""
    from tests.engine.conftest import make_hf_checkpoint
    from tests.engine.test_gguf_import import pack_q4_k, pack_q6_k

    root = tmp_path_factory.mktemp("q4km")
    ckpt, _ = make_hf_checkpoint(root / "k-moe", seed=7, hidden_size=256,
                                 moe_intermediate_size=256, intermediate_size=256,
                                 num_hidden_layers=2, num_experts=6, head_dim=64)
    tensors = {}
    for name, a in source_tensors(ckpt).items():
        if a.ndim == 1 or "ffn_gate_inp" in name:
            tensors[name] = (a, Q.F32)
        elif name.endswith(("attn_v.weight", "output.weight", "blk.0.ffn_down_exps.weight")):
            tensors[name] = (pack_q6_k(a), Q.Q6_K)
        else:
            tensors[name] = (pack_q4_k(a), Q.Q4_K)
    path = write_gguf(ckpt, root / "k-moe-q4_k_m.gguf", tensors)
    return ckpt, tensors, path


def test_a_q4_k_m_file_is_held_and_computed_as_stored(q4_k_m_gguf, tmp_path):
    """Per-layer expert types, slots of the largest layer's pair (what `strata plan` states),
    the file's bytes in the host store, attention and lm_head in their own types; logits
    within the stated tolerance of the dequantized file's fp32 forward."""
    from services.engine.model.blocks import BlockMatrix
    from services.engine.model.tokenizer import Tokenizer
    from tests.engine.test_gguf_import import rel_rms

    ckpt, tensors, path = q4_k_m_gguf
    runner = ModelRunner(path, cache_slots=4, reserved_bytes=0)
    D, F = runner.config.hidden_size, runner.config.moe_intermediate_size
    fmt = runner.cache.format
    assert fmt.types == {0: ("Q4_K", "Q4_K", "Q6_K"), 1: ("Q4_K",) * 3}
    assert runner.slot_bytes == 2 * F * D // 256 * 144 + D * F // 256 * 210
    assert runner.slot_bytes == slot_bytes_of(path)
    reader = open_checkpoint(path, weight_names(runner.config))
    for layer, expert in [(0, 1), (1, 4)]:
        stored = np.concatenate([s.reshape(-1) for s in reader.expert_blocks(layer, expert)])
        blob = runner.cache.host.blob((layer, expert)).numpy()
        assert np.array_equal(blob[:stored.size], stored)
    attn = runner.model.layers[1].attn
    assert isinstance(attn.qkv, BlockMatrix) and attn.qkv.block_types == ("Q4_K", "Q4_K", "Q6_K")
    assert isinstance(runner.model.lm_head, BlockMatrix)
    assert runner.model.lm_head.block_types == ("Q6_K",)
    assert runner.model.fusable
    embed = runner.model.embed  # the table stays Q4_K: a lookup dequantizes its rows
    assert isinstance(embed, BlockMatrix) and embed.block_types == ("Q4_K",)
    ids = torch.tensor([[3, 200], [7, 7]])
    assert torch.equal(runner.model.embed_rows(ids).float(), embed.dequantize()[ids])
    assert embed.nbytes == runner.config.vocab_size * (D // 256 * 144)  # 4.5 bits a weight
    reference = dequantized_file(ckpt, tensors, tmp_path / "k-moe-dequantized.gguf")
    ids = Tokenizer(ckpt).encode(PROMPT)
    got = greedy_logits(path, ids, steps=0, dtype="fp32")
    want = greedy_logits(reference, ids, steps=0, dtype="fp32")
    assert rel_rms(got, want) <= 0.02


@pytest.mark.parametrize("placement", ["host", "copy"])
def test_q4_k_m_greedy_output_is_identical_across_cache_sizes(q4_k_m_gguf, placement):
    _, _, path = q4_k_m_gguf
    results = greedy_by_cache_size(path, (0, 3, 12), PROMPT, placement=placement)
    assert all(t == results[0][0] and torch.equal(lg, results[0][1]) for t, lg in results)


def test_mxfp4_experts_are_computed_as_stored(source, tmp_path):  # noqa: F811
    """gpt-oss's expert format: MXFP4 stacks (gguf-py quantizes them) in a file whose other
    2-D tensors are Q8_0 serve as stored, within the stated tolerance of the dequantized
    file's fp32 forward, with greedy output identical across cache sizes."""
    from services.engine.model.tokenizer import Tokenizer
    from tests.engine.test_gguf_import import rel_rms

    ckpt, _ = source
    floats = source_tensors(ckpt)
    tensors = {name: ((quantize(floats[name], Q.MXFP4), Q.MXFP4) if "_exps" in name else (a, q))
               for name, (a, q) in quantized(floats, Q.Q8_0).items()}
    path = write_gguf(ckpt, tmp_path / "tiny-mxfp4.gguf", tensors)
    runner = ModelRunner(path, cache_slots=6, reserved_bytes=0)
    D, F = runner.config.hidden_size, runner.config.moe_intermediate_size
    assert runner.cache.format.name == "mxfp4" and runner.slot_bytes == 3 * D * F // 32 * 17
    reference = dequantized_file(ckpt, tensors, tmp_path / "tiny-mxfp4-dequantized.gguf")
    ids = Tokenizer(ckpt).encode(PROMPT)
    got = greedy_logits(path, ids, steps=0, dtype="fp32")
    assert rel_rms(got, greedy_logits(reference, ids, steps=0, dtype="fp32")) <= 0.02
    outputs = greedy_by_cache_size(path, (0, 24), PROMPT)
    assert outputs[0][0] == outputs[1][0] and torch.equal(outputs[0][1], outputs[1][1])


def test_plan_counts_a_gguf_s_non_expert_weights_as_the_engine_holds_them(q8_0_gguf, source):  # noqa: F811
    """`strata plan`'s weight term for a GGUF (whose reader lists the expert stacks under no
    per-expert name): every tensor but the routed experts, once, its block-type matrices at
    their stored bytes — what the engine holds, and less than the same checkpoint in bf16."""
    from services.engine.runner import fixed_bytes_of

    ckpt, _ = source
    planned = fixed_bytes_of(q8_0_gguf, torch.float32)[0]
    held = ModelRunner(q8_0_gguf, cache_slots=0, reserved_bytes=0,
                       dtype="fp32").model.weight_bytes()
    assert planned == pytest.approx(held, rel=1e-3)
    assert planned < fixed_bytes_of(ckpt, torch.float32)[0]


@pytest.mark.parametrize("fixture", ["q8_0_gguf", "q4_k_m_gguf"])
def test_the_header_reads_as_gguf_py_reads_it(fixture, request):
    """GGUFHeader (the parse every load uses) gives gguf-py's GGUFReader's metadata values and
    tensor table: names, types, dims, offsets and the same bytes in the same shapes."""
    from services.engine.model.gguf_header import GGUFHeader

    path = request.getfixturevalue(fixture)
    path = path[-1] if isinstance(path, tuple) else path  # q4_k_m_gguf: (ckpt, tensors, path)
    header, reader = GGUFHeader(path), gguf.GGUFReader(str(path))
    want = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert header.fields == want and "tokenizer.ggml.tokens" in header.fields
    assert len(header.tensors) == len(reader.tensors)
    for got, ref in zip(header.tensors, reader.tensors, strict=True):
        assert (got.name, got.tensor_type, got.n_bytes, got.data_offset) == \
               (ref.name, ref.tensor_type, ref.n_bytes, ref.data_offset)
        assert got.shape.tolist() == ref.shape.tolist() and got.data.dtype == ref.data.dtype
        assert np.array_equal(got.data, ref.data)


def test_the_header_refuses_what_is_not_a_gguf_file(tmp_path):
    from services.engine.model.gguf_header import GGUFHeader

    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="magic"):
        GGUFHeader(bad)
    bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (1).to_bytes(8, "little")
                    + (0).to_bytes(8, "little") + (5).to_bytes(8, "little") + b"ab")
    with pytest.raises(ValueError, match="past the end"):
        GGUFHeader(bad)  # a tensor name longer than the file

    def header(version: int, *field: bytes) -> bytes:
        """A GGUF header with no tensors and the given metadata fields."""
        return (b"GGUF" + version.to_bytes(4, "little") + (0).to_bytes(8, "little")
                + len(field).to_bytes(8, "little") + b"".join(field))

    def key(name: bytes, kind: int) -> bytes:
        return len(name).to_bytes(8, "little") + name + kind.to_bytes(4, "little")

    for raw, message in [
        (header(3 << 24), "big-endian"),
        (header(1), "version 1"),
        (header(3, key(b"x", 13)), "unknown metadata value type 13"),
        (header(3, key(b"x", 9) + (9).to_bytes(4, "little") + (1).to_bytes(8, "little")),
         "arrays of type 9"),
    ]:
        bad.write_bytes(raw)
        with pytest.raises(ValueError, match=message):
            GGUFHeader(bad)
    bad.write_bytes(header(3, key(b"general.name", 8) + (2).to_bytes(8, "little") + b"ok"))
    assert GGUFHeader(bad).fields == {"general.name": "ok"} and GGUFHeader(bad).tensors == []
