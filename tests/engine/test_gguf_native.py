"""GGUF experts kept as stored (#19, first block type: Q8_0): the host store, the slots and the
link carry the file's bytes; each product dequantizes them as the block type defines."""

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
from tests.engine.test_runner import greedy  # noqa: E402


def test_q8_0_blocks_dequantize_as_gguf_py_does():
    """The format's dequantization equals gguf-py's reference bit for bit, for the three
    matrices of a blob (gate and up: F rows of D; down: D rows of F)."""
    rng = np.random.default_rng(0)
    D, F = 64, 96
    mats = [rng.standard_normal(s).astype(np.float32) * 0.05 for s in ((F, D), (F, D), (D, F))]
    stored = [quantize(m, Q.Q8_0) for m in mats]  # uint8 rows of blocks
    fmt = BlockFormat(D, F, "Q8_0")
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
    with pytest.raises(ValueError, match="not kept as stored"):
        BlockFormat(D, F, "Q4_K")
    with pytest.raises(ValueError, match="whole blocks of 32"):
        BlockFormat(48, F, "Q8_0")


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
    assert reader.expert_storage() == "Q8_0"
    for layer, expert in [(0, 0), (1, 5), (2, 7)]:
        stored = np.concatenate([s.reshape(-1) for s in reader.expert_blocks(layer, expert)])
        assert np.array_equal(runner.cache.host.blob((layer, expert)).numpy(), stored)


def test_q8_0_experts_compute_what_their_dequantized_weights_do(q8_0_gguf, source, tmp_path):  # noqa: F811
    """The same file with its expert stacks dequantized to F32 (every other tensor the same)
    gives the same greedy tokens and logits to float rounding: the experts' bytes are the
    only thing that differs, and they dequantize exactly."""
    ckpt, _ = source
    tensors = quantized(source_tensors(ckpt), Q.Q8_0)
    dense = {name: ((dequantize(a, q), Q.F32) if "_exps" in name else (a, q))
             for name, (a, q) in tensors.items()}
    f32_experts = write_gguf(ckpt, tmp_path / "tiny-q8_0-f32-experts.gguf", dense)
    from services.engine.model.tokenizer import Tokenizer

    ids = Tokenizer(ckpt).encode(PROMPT)
    got = greedy_logits(q8_0_gguf, ids, steps=0, dtype="fp32")
    want = greedy_logits(f32_experts, ids, steps=0, dtype="fp32")
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    native = ModelRunner(q8_0_gguf, cache_slots=10**6, reserved_bytes=0, dtype="fp32")
    widened = ModelRunner(f32_experts, cache_slots=10**6, reserved_bytes=0, dtype="fp32")
    assert greedy(native, PROMPT, n=12)[1] == greedy(widened, PROMPT, n=12)[1]


@pytest.mark.parametrize("placement", ["host", "copy"])
def test_q8_0_greedy_output_is_identical_across_cache_sizes(q8_0_gguf, placement):
    results = []
    for slots in (0, 6, 24):
        runner = ModelRunner(q8_0_gguf, cache_slots=slots, reserved_bytes=0,
                             placement=placement)
        runner.fill_cache(runner.layer_order_pairs()[::-1])
        _, tokens, logits = greedy(runner, PROMPT, n=10)
        results.append((tokens, logits))
    assert all(t == results[0][0] and torch.equal(lg, results[0][1]) for t, lg in results)


@pytest.mark.parametrize("T", [1, 3, 4, 5, 9])
def test_the_c_kernel_reads_q8_0_blocks_as_the_reference_computes_them(T):
    """strata_moe on Q8_0 blobs equals the format's torch reference (dequantize, then the
    expert MLP) to float rounding, and a row's result is the same bits alone or in any batch
    and from any address (a slot, the host store)."""
    from services.engine import kernels
    from services.engine.cache.layout import num_splits

    try:
        cpu = kernels.CpuKernels(kernels.build())
    except (kernels.KernelBuildError, OSError) as exc:
        pytest.skip(f"the CPU kernels do not build here: {exc}")
    rng = np.random.default_rng(T)
    D, Fs, E, K = 128, 96, 10, 3
    fmt = BlockFormat(D, Fs, "Q8_0")
    blobs = torch.from_numpy(np.stack([np.concatenate([
        quantize(rng.standard_normal(s).astype(np.float32) * 0.1, Q.Q8_0).reshape(-1)
        for s in ((Fs, D), (Fs, D), (D, Fs))]) for _ in range(E)]))  # [E, blob bytes]
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, D, generator=g)
    top_idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    top_w = torch.rand(T, K, generator=g)

    def run(blobs, x, top_idx, top_w):
        addr = np.array([b.data_ptr() for b in blobs], dtype=np.int64)
        return cpu.moe(x, top_idx, top_w, addr, Fs, num_splits(D), weights="q8_0")

    y = run(blobs, x, top_idx, top_w)
    want = torch.zeros_like(x)
    for t in range(T):
        for k in sorted(range(K), key=lambda k: int(top_idx[t, k])):
            want[t] += top_w[t, k] * fmt.forward(x[t:t + 1], blobs[int(top_idx[t, k])])[0]
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    alone = torch.cat([run(blobs, x[t:t + 1].clone(), top_idx[t:t + 1].clone(),
                           top_w[t:t + 1].clone()) for t in range(T)])
    assert torch.equal(y, alone)
    assert torch.equal(run(blobs.clone(), x, top_idx, top_w), y)


def test_a_q8_0_lm_head_is_read_as_stored_by_the_cpu_kernels(q8_0_gguf):
    """The lm_head (the largest matrix of a step) stays Q8_0 where the backend reads blocks:
    strata_linear_q8_0 equals its reference (dequantize, then the product) to float rounding,
    a row's logits are the same bits alone or batched, and the torch backend, which has no
    such kernel, gets the dequantized matrix at load and the same greedy tokens."""
    from services.engine.model.blocks import BlockMatrix

    kernels_on = ModelRunner(q8_0_gguf, cache_slots=6, reserved_bytes=0, cpu_kernels="on")
    head = kernels_on.model.lm_head
    assert isinstance(head, BlockMatrix) and head.blocks.dtype == torch.uint8
    D = kernels_on.config.hidden_size
    assert head.blocks.shape == (kernels_on.config.vocab_size, D // 32 * 34)
    x = torch.randn(5, D)
    got = kernels_on.backend.linear(x, head)
    torch.testing.assert_close(got, x @ head.dequantize().T, rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.cat([kernels_on.backend.linear(x[i:i + 1].clone(), head)
                                  for i in range(5)]), got)
    torch_ops = ModelRunner(q8_0_gguf, cache_slots=6, reserved_bytes=0, cpu_kernels="off")
    assert isinstance(torch_ops.model.lm_head, torch.Tensor)
    assert greedy(kernels_on, PROMPT, n=8)[1] == greedy(torch_ops, PROMPT, n=8)[1]


def test_q8_0_attention_runs_as_stored_in_the_fused_decode_layer(q8_0_gguf):
    """q/k/v and o stay Q8_0 rows where the CPU kernels run (prefill through
    strata_linear_q8_0, decode steps in the fused decode layer); the decode steps' logits equal
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
