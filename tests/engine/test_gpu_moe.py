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

from services.engine.cache.layout import ExpertLayout, num_splits  # noqa: E402

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
    out = gpu_moe.moe(x, top_w, gpu_moe.group_rows(top_idx.numpy()), addresses(blobs), F,
                      num_splits(D))
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
    whole = gpu_moe.moe(x, top_w, gpu_moe.group_rows(top_idx.numpy()), addr, F, num_splits(D))
    for t in (0, 7, 18):  # a token alone: the same bits as inside the batch on the device
        alone = gpu_moe.moe(x[t : t + 1], top_w[t : t + 1],
                            gpu_moe.group_rows(top_idx[t : t + 1].numpy()), addr, F,
                            num_splits(D))
        if DEVICE.type == "cuda":
            assert torch.equal(alone[0], whole[t])
        else:  # the interpreter's tl.dot is numpy's matmul: blocking varies with the shape
            torch.testing.assert_close(alone[0], whole[t], atol=1e-6, rtol=1e-6)
    moved = blobs.flip(0).clone().flip(0)  # the same bytes elsewhere
    assert moved.data_ptr() != blobs.data_ptr()
    elsewhere = gpu_moe.moe(x, top_w, gpu_moe.group_rows(top_idx.numpy()), addresses(moved), F,
                            num_splits(D))
    assert torch.equal(elsewhere, whole)
    first = np.zeros(6, dtype=bool)
    first[[1, 4]] = True
    groups = gpu_moe.group_rows(top_idx.numpy(), first)
    calls = []
    split = gpu_moe.moe(x, top_w, groups, addr, F, num_splits(D),
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
    on_device = gpu_moe.moe(x, top_w, groups, addresses(blobs), F, num_splits(D))
    in_place = gpu_moe.moe(x, top_w, groups, addresses(host), F, num_splits(D))
    assert torch.equal(in_place, on_device)
    one = gpu_moe.expert_forward(x, host[2], F, num_splits(D))
    assert torch.equal(one, gpu_moe.expert_forward(x, blobs[2], F, num_splits(D)))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_experts_run_close_to_fp32():
    layout = ExpertLayout(D, F)
    blobs = experts(4, seed=9)
    top_idx, top_w = routing(12, 4, 2, seed=10)
    x = torch.randn(12, D, device=DEVICE)
    groups = gpu_moe.group_rows(top_idx.numpy())
    half = blobs.bfloat16()
    out = gpu_moe.moe(x.bfloat16(), top_w.bfloat16(), groups, addresses(half), F, num_splits(D))
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
    host = gpu_moe.moe(x, top_w, gpu_moe.group_rows(top_idx.numpy()), addr, F, num_splits(D))
    device = gpu_moe.moe_device(x, top_idx.to(DEVICE), top_w, torch.from_numpy(addr).to(DEVICE),
                                F, num_splits(D))
    if DEVICE.type == "cuda":
        assert torch.equal(device, host)
    else:
        torch.testing.assert_close(device, host, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(("H", "G", "Hd", "P"), [(4, 2, 16, 16), (8, 8, 64, 4), (6, 2, 24, 8)])
def test_paged_decode_attention_matches_attention_over_each_sequence(H, G, Hd, P):
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
    out = decode_attention(q, k, v, ids.to(DEVICE), torch.tensor(lengths).to(DEVICE), Hd**-0.5)
    for i, (table, n) in enumerate(zip(tables, lengths, strict=True)):
        kk = k[table].flatten(0, 1)[:n].transpose(0, 1).cpu()  # [G, N, Hd]
        vv = v[table].flatten(0, 1)[:n].transpose(0, 1).cpu()
        want = reference_attention(q[i : i + 1].cpu(), kk, vv)[0]
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
    from services.engine.kernels import gpu_ops
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
    runs = []
    for graphed in (False, True):
        runner = ModelRunner(tiny_dir, cache_slots=6,
                             reserved_bytes=0, policy=PolicySpec(policy, 0.25),
                             prefetch=False)
        if graphed:
            runner.cache.compute = TritonMoe(gpu_moe, runner.cache.format,
                                             runner.config.num_experts, runner.device)
            runner.model.fusable = False  # not the fused CPU decode
            runner.model.backend = TritonBackend(runner.device, gpu_ops)  # the graph's ops
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
    assert set(d1.reasons) <= {"host:graph"} and sum(d1.reasons.values()) > 0
    cache = runner.cache
    for pair in cache.host.pairs:
        slot = cache.residency.lookup(pair)
        blob = cache.host.blob(pair) if slot is None else cache.pool.slots[slot]
        assert int(cache.addr_table[pair]) == blob.data_ptr()


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
