"""The Triton MoE kernel (services.engine.kernels.gpu_moe): on a CUDA device when there is one,
else in Triton's interpreter on the CPU (same kernel source, numpy underneath)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernels' definition
gpu_moe = pytest.importorskip("services.engine.kernels.gpu_moe")


def _interpreter_scalars_index() -> None:
    """Triton 3.6's interpreter holds a loaded scalar as a 1-element array and turns it into a
    Python int (a loop bound) with int(array), which numpy >= 2.3 refuses for 1-d arrays;
    index it instead. Interpreter only: compiled kernels never take this path."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope):  # noqa: ANN001 - the interpreter's own signature
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


if not torch.cuda.is_available():
    _interpreter_scalars_index()

from services.engine.cache.formats import BlockFormat, Fp8Format  # noqa: E402
from services.engine.cache.layout import ExpertLayout  # noqa: E402
from services.engine.model.blocks import block_type  # noqa: E402
from tests.engine.test_gguf_native import q4_k_m_gguf  # noqa: E402, F401 - a fixture

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
D, F = 128, 96  # F not a multiple of BLOCK_F: the masked tails run too


def experts(num: int, seed: int = 0, layout: ExpertLayout | None = None) -> torch.Tensor:
    layout = layout or ExpertLayout(D, F)
    g = torch.Generator().manual_seed(seed)
    blobs = torch.empty(num, layout.numel)
    for e in range(num):
        gate, up = (torch.randn(F, D, generator=g) * 0.1 for _ in range(2))
        layout.pack(gate, up, torch.randn(D, F, generator=g) * 0.1, out=blobs[e])
    return blobs.to(DEVICE)


def routing(T: int, E: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(T, E, generator=g), dim=-1)
    top_w, top_idx = torch.topk(probs, K, dim=-1)  # [T, K], not sorted by expert id
    return top_idx, top_w.to(DEVICE)


def addresses(blobs: torch.Tensor) -> np.ndarray:
    return np.array([b.data_ptr() for b in blobs], dtype=np.int64)


def reference(x, top_idx, top_w, blobs, layout) -> torch.Tensor:
    """Each token: its experts' outputs times their weights, summed in ascending expert id."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in np.argsort(top_idx[t].numpy(), kind="stable"):
            y = layout.forward(x[t : t + 1].double().cpu(), blobs[top_idx[t, k]].double().cpu())
            out[t] += float(top_w[t, k]) * y[0]
    return out


@pytest.mark.parametrize(("T", "E", "K"), [(1, 8, 2), (21, 8, 3), (40, 4, 2)])
def test_routed_experts_match_the_float64_reference(T, E, K):
    layout = ExpertLayout(D, F)
    blobs = experts(E)
    top_idx, top_w = routing(T, E, K, seed=T)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    out = gpu_moe.moe(x, top_w, gpu_moe.group_rows(top_idx.numpy()), addresses(blobs), F)
    want = reference(x, top_idx, top_w, blobs, layout)
    err = (out.double().cpu() - want).norm() / want.norm()
    assert err < 1e-6, err


def test_groups_cover_every_row_once_in_ascending_expert_order():
    top_idx, _ = routing(37, 4, 3, seed=5)  # ~28 rows per expert: two groups for some
    g = gpu_moe.group_rows(top_idx.numpy())
    assert (g.length >= 1).all() and (g.length <= gpu_moe.BLOCK_M).all()
    covered = np.concatenate([np.arange(s, s + n) for s, n in zip(g.start, g.length, strict=True)])
    assert sorted(covered.tolist()) == list(range(37 * 3))
    flat = top_idx.numpy().ravel()
    by_row = np.empty(37 * 3, dtype=np.int64)
    by_row[g.dst] = np.repeat(g.expert, g.length)[np.argsort(covered)]  # expert of y's row
    assert (np.diff(by_row.reshape(37, 3), axis=1) > 0).all()  # per token ascending
    assert sorted(by_row.tolist()) == sorted(flat.tolist())
    assert (flat[g.w_src] == by_row).all()  # each row weighted by its own expert's weight
    first = np.zeros(4, dtype=bool)
    first[2] = True
    g2 = gpu_moe.group_rows(top_idx.numpy(), first)
    assert (g2.expert[: int(first[g2.expert].sum())] == 2).all()


def test_results_do_not_depend_on_the_batch_the_address_or_the_launch_split():
    layout = ExpertLayout(D, F)
    blobs = experts(6, seed=1)
    top_idx, top_w = routing(19, 6, 2, seed=2)
    x = torch.randn(19, D, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    addr = addresses(blobs)
    whole = gpu_moe.moe(x, top_w, gpu_moe.group_rows(top_idx.numpy()), addr, F)
    for t in (0, 7, 18):  # a token alone: the same bits as inside the batch on the device
        alone = gpu_moe.moe(x[t : t + 1], top_w[t : t + 1],
                            gpu_moe.group_rows(top_idx[t : t + 1].numpy()), addr, F)
        if DEVICE.type == "cuda":
            assert torch.equal(alone[0], whole[t])
        else:  # the interpreter's tl.dot is numpy's matmul: blocking varies with the shape
            torch.testing.assert_close(alone[0], whole[t], atol=1e-6, rtol=1e-6)
    moved = blobs.flip(0).clone().flip(0)  # the same bytes elsewhere
    assert moved.data_ptr() != blobs.data_ptr()
    elsewhere = gpu_moe.moe(x, top_w, gpu_moe.group_rows(top_idx.numpy()), addresses(moved), F)
    assert torch.equal(elsewhere, whole)
    first = np.zeros(6, dtype=bool)
    first[[1, 4]] = True
    groups = gpu_moe.group_rows(top_idx.numpy(), first)
    calls = []
    split = gpu_moe.moe(x, top_w, groups, addr, F,
                        split=int(first[groups.expert].sum()), between=lambda: calls.append(1))
    assert calls == [1] and torch.equal(split, whole)
    assert reference(x[:1], top_idx[:1], top_w[:1], blobs, layout).abs().sum() > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_pinned_host_blob_is_read_in_place_with_the_bits_of_a_slot():
    blobs = experts(4, seed=7)
    host = blobs.cpu().pin_memory()
    top_idx, top_w = routing(9, 4, 2, seed=8)
    x = torch.randn(9, D, device=DEVICE)
    groups = gpu_moe.group_rows(top_idx.numpy())
    on_device = gpu_moe.moe(x, top_w, groups, addresses(blobs), F)
    in_place = gpu_moe.moe(x, top_w, groups, addresses(host), F)
    assert torch.equal(in_place, on_device)
    one = gpu_moe.expert_forward(x, host[2], F)
    assert torch.equal(one, gpu_moe.expert_forward(x, blobs[2], F))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_experts_run_close_to_fp32():
    layout = ExpertLayout(D, F)
    blobs = experts(4, seed=9)
    top_idx, top_w = routing(12, 4, 2, seed=10)
    x = torch.randn(12, D, device=DEVICE)
    groups = gpu_moe.group_rows(top_idx.numpy())
    half = blobs.bfloat16()
    out = gpu_moe.moe(x.bfloat16(), top_w.bfloat16(), groups, addresses(half), F)
    want = reference(x, top_idx, top_w, blobs, layout)
    err = (out.double().cpu() - want).norm() / want.norm()
    assert out.dtype == torch.bfloat16 and err < 2e-2, err


def test_device_grouping_gives_the_host_grouping_bits():
    """moe_device (one group per row, indices built on the device: what a CUDA graph runs)
    against moe (host-built groups of up to BLOCK_M rows)."""
    blobs = experts(5, seed=11)
    top_idx, top_w = routing(23, 5, 3, seed=12)
    x = torch.randn(23, D, generator=torch.Generator().manual_seed(13)).to(DEVICE)
    addr = addresses(blobs)
    host = gpu_moe.moe(x, top_w, gpu_moe.group_rows(top_idx.numpy()), addr, F)
    device = gpu_moe.moe_device(x, top_idx.to(DEVICE), top_w, torch.from_numpy(addr).to(DEVICE),
                                F)
    if DEVICE.type == "cuda":
        assert torch.equal(device, host)
    else:
        torch.testing.assert_close(device, host, atol=1e-6, rtol=1e-6)


def stored_experts(fmt, num: int, seed: int) -> torch.Tensor:
    """uint8 [num, blob bytes]: random blobs of a BlockFormat (every type's random blocks from
    test_block_kernels) or an Fp8Format (random non-NaN codes, scales around 1e-3)."""
    rng = np.random.default_rng(seed)
    D, Fs = fmt.hidden_size, fmt.ffn_size
    if isinstance(fmt, Fp8Format):
        codes = rng.integers(0, 256, size=(num, 3 * D * Fs), dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0  # e4m3fn's NaN codes
        scales = rng.uniform(0.5, 2.0, size=(num, sum(fmt.scales))).astype(np.float32) * 1e-3
        return torch.from_numpy(np.concatenate([codes, scales.view(np.uint8)], axis=1))
    from tests.engine.test_block_kernels import random_rows

    (t,) = set(fmt.types.values())
    return torch.from_numpy(np.stack([np.concatenate([
        random_rows(t[0], Fs, D, rng).reshape(-1), random_rows(t[1], Fs, D, rng).reshape(-1),
        random_rows(t[2], D, Fs, rng).reshape(-1)]) for _ in range(num)]))


def stored_reference(fmt, x, top_idx, top_w, blobs) -> torch.Tensor:
    """Each token's experts on their reference dequantization (the format's torch weights()),
    in float64, summed in ascending expert id."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in np.argsort(top_idx[t].numpy(), kind="stable"):
            gate, up, down = fmt.weights(blobs[int(top_idx[t, k])].cpu(), torch.float64)
            xt = x[t : t + 1].double().cpu()
            h = torch.nn.functional.silu(xt @ gate.T) * (xt @ up.T)
            out[t] += float(top_w[t, k]) * (h @ down.T)[0]
    return out


def stored_weights(fmt) -> gpu_moe.Weights:
    if isinstance(fmt, Fp8Format):
        return gpu_moe.Weights.fp8(fmt.kernel_block)
    return gpu_moe.Weights.blocks(fmt.kernel_types, fmt.hidden_size, fmt.ffn_size)


STORED = [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q8_0", "Q8_0"), ("Q2_K", "Q3_K", "Q5_K"),
          ("Q4_0", "IQ4_NL", "Q8_0"), ("IQ4_XS", "MXFP4", "Q4_K"), ("MXFP4",) * 3, "fp8"]


def stored_format(types):
    if types == "fp8":  # FFN 192: the last scale block of each row is half full
        return Fp8Format(256, 192, (128, 128))
    small = all(block_type(t).weights == 32 for t in types)  # FFN 96: masked column tails
    return BlockFormat(256, 96 if small else 256, {0: types})


@pytest.mark.parametrize("types", STORED, ids=lambda t: "+".join(t) if t != "fp8" else t)
def test_stored_experts_match_their_reference_dequantization(types):
    """GGUF block types and FP8 codes dequantized in registers inside the kernels (fp32 here):
    equal to the format's own reference dequantization, then the expert MLP in float64, to
    fp32 rounding; blobs elsewhere and (for one set of types: the interpreter is slow) the
    device-built grouping give the same result."""
    fmt = stored_format(types)
    blobs = stored_experts(fmt, 4, seed=len(types)).to(DEVICE)
    assert blobs.shape[1] == fmt.blob_bytes
    top_idx, top_w = routing(5, 4, 2, seed=14)
    x = torch.randn(5, fmt.hidden_size, generator=torch.Generator().manual_seed(15)).to(DEVICE)
    weights, addr = stored_weights(fmt), addresses(blobs)
    F_ = fmt.ffn_size
    out = gpu_moe.moe(x, top_w, gpu_moe.group_rows(top_idx.numpy()), addr, F_,
                      weights=weights)
    want = stored_reference(fmt, x, top_idx, top_w, blobs)
    err = (out.double().cpu() - want).norm() / want.norm()
    assert err < 1e-6, err
    moved = blobs.flip(0).clone().flip(0)
    assert torch.equal(gpu_moe.moe(x, top_w, gpu_moe.group_rows(top_idx.numpy()),
                                   addresses(moved), F_, weights=weights), out)
    if types != STORED[0] and DEVICE.type != "cuda":
        return
    device = gpu_moe.moe_device(x, top_idx.to(DEVICE), top_w, torch.from_numpy(addr).to(DEVICE),
                                F_, weights=weights)
    if DEVICE.type == "cuda":
        assert torch.equal(device, out)
    else:
        torch.testing.assert_close(device, out, atol=1e-6, rtol=1e-6)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), "fp8"], ids=["q4_k_m", "fp8"])
def test_stored_experts_read_in_place_from_pinned_host_memory_in_bf16(types):
    """The serving case: bf16 activations, blobs in a slot or pinned on the host give the
    same bits, close to the fp32 reference."""
    fmt = stored_format(types)
    blobs = stored_experts(fmt, 4, seed=16)
    top_idx, top_w = routing(12, 4, 2, seed=17)
    x = torch.randn(12, fmt.hidden_size, device=DEVICE)
    groups, weights = gpu_moe.group_rows(top_idx.numpy()), stored_weights(fmt)
    F_ = fmt.ffn_size
    on_device = gpu_moe.moe(x.bfloat16(), top_w.bfloat16(), groups, addresses(blobs.to(DEVICE)),
                            F_, weights=weights)
    host = blobs.pin_memory()
    in_place = gpu_moe.moe(x.bfloat16(), top_w.bfloat16(), groups, addresses(host), F_,
                           weights=weights)
    assert torch.equal(in_place, on_device)
    want = stored_reference(fmt, x, top_idx, top_w, blobs)
    err = (on_device.double().cpu() - want).norm() / want.norm()
    assert err < 2e-2, err


@pytest.mark.parametrize("segments", [(("Q8_0", 40),), (("Q4_K", 96), ("Q6_K", 32)),
                                      (("IQ4_XS", 16), ("MXFP4", 70), ("Q3_K", 8))],
                         ids=lambda s: "+".join(t for t, _ in s))
def test_block_matrix_product_matches_its_dequantized_weights(segments):
    """gpu_blocks.linear (CUDA's lm_head / attention products as the file stores them): each
    segment's rows in its own type, x with strided rows, the masked tails of a 70-row segment;
    equal to x @ dequantize().T in float64, to fp32 rounding."""
    from services.engine.kernels import gpu_blocks
    from services.engine.model.blocks import BlockMatrix
    from tests.engine.test_block_kernels import random_rows

    rng = np.random.default_rng(len(segments))
    K = 512
    data = np.concatenate([random_rows(t, n, K, rng).reshape(-1) for t, n in segments])
    w = BlockMatrix(torch.from_numpy(data).to(DEVICE), K, segments)
    x = torch.randn(5, 2 * K, generator=torch.Generator().manual_seed(18)).to(DEVICE)[:, :K]
    got = gpu_blocks.linear(x, w)
    want = x.double().cpu() @ w.dequantize(torch.float64).cpu().T
    assert got.shape == (5, w.out_features) and got.dtype == x.dtype
    err = (got.double().cpu() - want).norm() / want.norm()
    assert err < 1e-6, err


def test_fp8_matrix_product_matches_its_dequantized_weights():
    """gpu_blocks.linear_fp8 (an FP8 checkpoint's attention on CUDA, as stored): 70 rows of
    104 inputs in 32 x 16 scale blocks, ragged in both; to fp32 rounding."""
    from services.engine.kernels import gpu_blocks
    from services.engine.model.blocks import Fp8Matrix

    rng = np.random.default_rng(19)
    codes = rng.integers(0, 256, size=(70, 104), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # e4m3fn's NaN codes
    scales = rng.uniform(0.5, 2.0, size=(3, 7)).astype(np.float32) * 1e-2
    w = Fp8Matrix(torch.from_numpy(codes).to(DEVICE), torch.from_numpy(scales).to(DEVICE),
                  (32, 16))
    x = torch.randn(5, 208, generator=torch.Generator().manual_seed(20)).to(DEVICE)[:, :104]
    got = gpu_blocks.linear_fp8(x, w)
    want = x.double().cpu() @ w.dequantize(torch.float64).cpu().T
    err = (got.double().cpu() - want).norm() / want.norm()
    assert got.shape == (5, 70) and err < 1e-6, err


@pytest.mark.parametrize("name", ["fp32", "mxfp4", "fp8"])
def test_gpt_oss_experts_compute_the_clamped_swiglu_with_their_biases(name):
    """Weights.of(fmt) compiles gpt-oss's MLP into the kernels: each expert's biases read from
    its blob's tail, the clamped activation; equal to the float64 reference of the format's
    weights."""
    from tests.engine.test_expert_mlp import E, K, blobs_of, formats

    fmt = formats()[name]
    blobs = blobs_of(fmt, np.random.default_rng(11)).to(DEVICE)
    top_idx, top_w = routing(4, E, K, seed=21)
    x = torch.randn(4, fmt.hidden_size, generator=torch.Generator().manual_seed(22)).to(DEVICE)
    out = gpu_moe.moe(x, top_w, gpu_moe.group_rows(top_idx.numpy()), addresses(blobs),
                      fmt.ffn_size, weights=gpu_moe.Weights.of(fmt))
    want = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(4):
        for k in np.argsort(top_idx[t].numpy(), kind="stable"):
            blob = blobs[int(top_idx[t, k])].cpu()
            gate, up, down = fmt.weights(blob, torch.float64)
            want[t] += float(top_w[t, k]) * fmt.mlp.forward(
                x[t:t + 1].double().cpu(), gate, up, down, fmt.biases(blob).double())[0]
    err = (out.double().cpu() - want).norm() / want.norm()
    assert err < 1e-6, err


@pytest.mark.parametrize(("sinks", "window"), [(False, 0), (True, 0), (True, 5), (False, 17)])
@pytest.mark.parametrize(("H", "G", "Hd", "P"), [(4, 2, 16, 16), (8, 8, 64, 4), (6, 2, 24, 8)])
def test_paged_decode_attention_matches_attention_over_each_sequence(H, G, Hd, P, sinks,
                                                                     window):
    from services.engine.kernels.gpu_ops import decode_attention
    from services.engine.model.layers.attention import (
        single_query_attention as reference_attention,
    )

    gen = torch.Generator().manual_seed(H * 100 + Hd)
    B, T = 12, 3
    k = torch.randn(B, P, G, Hd, generator=gen).to(DEVICE)
    v = torch.randn(B, P, G, Hd, generator=gen).to(DEVICE)
    q = torch.randn(T, H, Hd, generator=gen).to(DEVICE)
    lengths = [1, P + 3, 3 * P]  # one position, a partial block, whole blocks
    tables = [[7], [2, 9], [11, 0, 5]]
    ids = torch.zeros(T, 4, dtype=torch.int64)  # wider than needed: never read past a length
    for i, table in enumerate(tables):
        ids[i, : len(table)] = torch.tensor(table)
    sink = torch.randn(H, generator=gen) * 2 if sinks else None  # gpt-oss's attention sinks
    out = decode_attention(q, k, v, ids.to(DEVICE), torch.tensor(lengths).to(DEVICE), Hd**-0.5,
                           None if sink is None else sink.to(DEVICE), window)
    for i, (table, n) in enumerate(zip(tables, lengths, strict=True)):
        first = max(0, n - window) if window else 0  # a sliding window: the last positions
        kk = k[table].flatten(0, 1)[first:n].transpose(0, 1).cpu()  # [G, N, Hd]
        vv = v[table].flatten(0, 1)[first:n].transpose(0, 1).cpu()
        want = reference_attention(q[i : i + 1].cpu(), kk, vv, sink)[0]
        torch.testing.assert_close(out[i].cpu(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the real graphs run in test_cache_cuda")
@pytest.mark.parametrize("policy", ["static", "lru"])
def test_graphed_step_logic_equals_eager_steps_on_the_cpu(tiny_dir, monkeypatch, policy):
    """What a graphed decode step computes and books, without a GPU: the graph body run
    directly (a stand-in CUDAGraph whose replay calls it), the kernels in the interpreter.
    Tokens, lookups, hits and fills equal the eager steps', and the address table agrees with
    the residency after every fill."""
    from services.engine.cache.moe_compute import TritonMoe
    from services.engine.cache.policy import PolicySpec
    from services.engine.kernels import gpu_blocks, gpu_ops
    from services.engine.kernels.backend import TritonBackend
    from services.engine.model import cuda_graphs
    from services.engine.runner import ModelRunner
    from tests.engine.test_runner import greedy

    class ReplayCallsTheBody:
        def __init__(self):
            self.body = None

        def replay(self):
            self.body()

    def capture(self, g):
        def body():
            g.hidden, g.logits = self._body(g)

        g.graph.body = body

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", ReplayCallsTheBody)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "_capture", capture)
    # the experts in the [out, in] layout a CUDA device keeps (the Triton kernels read it)
    monkeypatch.setattr("services.engine.runner.inputs_major", lambda *a: False)
    runs = []
    for graphed in (False, True):
        runner = ModelRunner(tiny_dir, cache_slots=6,
                             reserved_bytes=0, policy=PolicySpec(policy, 0.25),
                             prefetch=False)
        if graphed:
            runner.cache.compute = TritonMoe(gpu_moe, runner.cache.format,
                                             runner.config.num_experts, runner.device)
            runner.model.fusable = False  # not the fused CPU decode
            runner.model.backend = TritonBackend(runner.device, gpu_ops,
                                                 gpu_blocks)  # the graph's ops
            runner.graphs = cuda_graphs.DecodeGraphs(runner.model, runner.kv, runner.cache)
            runner.graphs.capture([1])
        runner.fill_cache(runner.layer_order_pairs()[::-1])
        _, tokens, _ = greedy(runner, "The expert cache keeps", n=10)
        runs.append((tokens, runner.cache.decode, runner))
    (t0, d0, _), (t1, d1, runner) = runs
    assert runner.graphs.replays == 10
    assert t1 == t0
    assert (d1.lookups, d1.hits, d1.fills) == (d0.lookups, d0.hits, d0.fills)
    assert d1.fills > 0 or policy == "static"  # lru refills its slots every step
    assert set(d1.reasons) <= {"host:table"} and sum(d1.reasons.values()) > 0
    cache = runner.cache
    for pair in cache.host.pairs:
        slot = cache.residency.lookup(pair)
        blob = cache.host.blob(pair) if slot is None else cache.pool.slots[slot]
        assert int(cache.addr_table[pair]) == blob.data_ptr()


def test_a_q4_k_m_file_runs_on_the_triton_kernels_as_its_reference(q4_k_m_gguf):  # noqa: F811
    """The CUDA path of a GGUF file (on a device, else in the interpreter with the CPU
    runner's parts swapped for the Triton ones): routed experts (layer 0's down stack Q6_K,
    layer 1's Q4_K: each layer's own kernel types), q | k | v (Q4_K, Q4_K, Q6_K) and the Q6_K
    lm_head all dequantized in registers by the Triton kernels. Greedy tokens equal the
    torch reference's (every weight dequantized at load, fp32) and the logits agree to fp32
    rounding, with part of the experts resident and the misses read in place."""
    from services.engine.cache.moe_compute import TritonMoe
    from services.engine.kernels import gpu_blocks, gpu_ops
    from services.engine.kernels.backend import TritonBackend
    from services.engine.model.blocks import BlockMatrix
    from services.engine.runner import ModelRunner
    from tests.engine.test_runner import greedy

    _, _, path = q4_k_m_gguf
    want = ModelRunner(path, cache_slots=0, reserved_bytes=0, cpu_kernels="off", dtype="fp32")
    _, want_tokens, want_logits = greedy(want, "The expert cache keeps", n=3)
    runner = ModelRunner(path, device=DEVICE.type, cache_slots=5, reserved_bytes=0,
                         dtype="fp32", placement="host", cuda_graphs=False)
    runner.fill_cache(runner.layer_order_pairs()[::2])
    if DEVICE.type == "cpu":
        runner.model.fusable = False  # not the fused CPU decode layer
        runner.model.backend = TritonBackend(runner.device, gpu_ops, gpu_blocks)
        runner.cache.compute = TritonMoe(gpu_moe, runner.cache.format,
                                         runner.config.num_experts, runner.device)
    assert isinstance(runner.model.backend, TritonBackend)
    assert isinstance(runner.cache.compute, TritonMoe)
    assert isinstance(runner.model.lm_head, BlockMatrix)
    _, tokens, logits = greedy(runner, "The expert cache keeps", n=3)
    assert tokens == want_tokens
    torch.testing.assert_close(logits.cpu(), want_logits, rtol=1e-4, atol=1e-4)


def test_rms_norm_and_qk_norm_rope_match_the_torch_ops():
    from services.engine.kernels import gpu_ops
    from services.engine.model.layers.rope import apply_rope, rope_tables

    gen = torch.Generator().manual_seed(21)
    x = torch.randn(5, 96, generator=gen)
    w = torch.randn(96, generator=gen)
    rows = torch.randn(5, 2 * 96, generator=gen)[:, 96:]  # strided rows
    for inp in (x, rows):
        want = w * (inp * torch.rsqrt(inp.pow(2).mean(-1, keepdim=True) + 1e-6))
        got = gpu_ops.rms_norm(inp.to(DEVICE), w.to(DEVICE), 1e-6)
        torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    H, G, T = 4, 2, 3
    for Hd, norm in ((16, True), (24, False)):  # 24: a half that is not a power of two
        cos, sin = rope_tables(Hd, 10000.0, 64, torch.device("cpu"))
        qkv = torch.randn(T, (H + 2 * G) * Hd, generator=gen)
        positions = torch.tensor([0, 7, 63])
        qn, kn = (torch.randn(Hd, generator=gen) for _ in range(2)) if norm else (None, None)
        want = qkv.clone()
        for lo, n, weight in ((0, H, qn), (H * Hd, G, kn)):
            heads = want[:, lo : lo + n * Hd].view(T, n, Hd)
            if norm:
                heads = weight * (heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + 1e-6))
            rotated = apply_rope(heads, cos[positions][:, None], sin[positions][:, None])
            want[:, lo : lo + n * Hd] = rotated.reshape(T, n * Hd)
        got = qkv.to(DEVICE)
        gpu_ops.qk_norm_rope(got, H, G, Hd, None if qn is None else qn.to(DEVICE),
                             None if kn is None else kn.to(DEVICE), 1e-6, cos.to(DEVICE),
                             sin.to(DEVICE), positions.to(DEVICE))
        torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)  # v untouched too
