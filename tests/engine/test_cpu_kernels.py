"""The CPU kernels (services/engine/kernels): each matches torch, a row's result never depends on
the other rows of the call (bit-identical), the fused decode layer equals the per-op kernels,
and the engine falls back to torch ops when they cannot be built."""

from __future__ import annotations

import logging
import os
import threading
import time

import numpy as np
import pytest
import torch

from services.engine import kernels
from services.engine.cache.layout import ExpertLayout
from services.engine.driver import SequenceDriver
from services.engine.kernels.backend import TorchBackend
from services.engine.model.checkpoint import load_model_config
from services.engine.model.layers.rope import apply_rope
from services.engine.runner import ModelRunner

# Where a compiler exists a failed build fails these tests (the `cpu` fixture builds, and the
# runners' cpu_kernels="auto" is checked to have used the kernels); without one they skip.
needs_compiler = pytest.mark.skipif(
    kernels.find_compiler() is None,
    reason="no C compiler here ($CC, cc, gcc, clang): the CPU kernels cannot be built")
rms_norm = TorchBackend(torch.device("cpu")).rms_norm


def rows_alone(fn, *row_args):
    """fn applied to each row on its own (a call with one row), stacked."""
    T = row_args[0].shape[0]
    return torch.cat([fn(*(a[t:t + 1].clone() for a in row_args)) for t in range(T)])


@pytest.mark.parametrize("n", [64, 100, 256, 600, 1000])
@pytest.mark.parametrize("T", [1, 2, 3, 5, 8, 9])
def test_linear_matches_torch_and_rows_are_independent(cpu, T, n):
    g = torch.Generator().manual_seed(T * 1000 + n)
    K = 96
    w = torch.randn(n, K, generator=g)  # [N, K] as the checkpoint stores it
    x = torch.randn(T, K, generator=g)
    y = cpu.linear(x, w)
    torch.testing.assert_close(y, x @ w.t(), rtol=1e-5, atol=1e-5)
    assert torch.equal(y, rows_alone(lambda r: cpu.linear(r, w), x))
    strided = torch.randn(T, 2 * K, generator=g)[:, :K]  # rows with a stride
    assert torch.equal(cpu.linear(strided, w), cpu.linear(strided.contiguous(), w))


def expert_reference(x, top_idx, top_w, blobs, layout):
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in sorted(range(top_idx.shape[1]), key=lambda k: int(top_idx[t, k])):
            y[t] += top_w[t, k] * layout.forward(x[t:t + 1], blobs[int(top_idx[t, k])])[0]
    return y


def random_moe(seed, T, D, Fs, E, K, inputs_major=False):
    """E random expert blobs of D x Fs (in the [in, out] layout with inputs_major), their
    addresses, and T rows routed to K of them: (layout, blobs, addr, x, top_idx, top_w)."""
    g = torch.Generator().manual_seed(seed)
    layout = ExpertLayout(D, Fs, inputs_major)
    blobs = torch.randn(E, layout.numel, generator=g) * 0.1
    addr = np.array([b.data_ptr() for b in blobs], dtype=np.int64)
    x = torch.randn(T, D, generator=g)
    top_idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return layout, blobs, addr, x, top_idx, torch.rand(T, K, generator=g)


def check_experts(cpu, T, weights):
    """strata_moe on random experts (`weights`: their layout) equals the per-expert torch path,
    row by row and at another address alike."""
    Fs = 64
    layout, blobs, addr, x, top_idx, top_w = random_moe(T, T, 128, Fs, 16, 4,
                                                        weights.endswith("_io"))
    y = cpu.moe(x, top_idx, top_w, addr, Fs, 2, weights=weights)
    torch.testing.assert_close(y, expert_reference(x, top_idx, top_w, blobs, layout),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(y, rows_alone(lambda *a: cpu.moe(*a, addr, Fs, 2, weights=weights),
                                     x, top_idx, top_w))
    # The same bytes at another address (a slot instead of the host store): the same result.
    copies = blobs.clone()
    moved = np.array([b.data_ptr() for b in copies], dtype=np.int64)
    assert torch.equal(cpu.moe(x, top_idx, top_w, moved, Fs, 2, weights=weights), y)


def check_bf16_is_fp32_widened(cpu, T):
    """bf16 expert blobs give the fp32 kernel's bits on the same weights widened, in either
    layout."""
    for inputs_major, suffix in ((False, ""), (True, "_io")):
        _, blobs, _, x, top_idx, top_w = random_moe(20 + T, T, 128, 64, 16, 4, inputs_major)
        half = blobs.bfloat16()
        wide = half.float()
        y16 = cpu.moe(x, top_idx, top_w, np.array([b.data_ptr() for b in half]), 64, 2,
                      weights="bf16" + suffix)
        y32 = cpu.moe(x, top_idx, top_w, np.array([b.data_ptr() for b in wide]), 64, 2,
                      weights="fp32" + suffix)
        assert torch.equal(y16, y32), inputs_major


@pytest.mark.parametrize("weights", ["fp32", "fp32_io"])
@pytest.mark.parametrize("T", [1, 4, 7, 40])
def test_moe_matches_the_per_expert_torch_path_and_rows_are_independent(cpu, T, weights):
    check_experts(cpu, T, weights)


@pytest.mark.parametrize("T", [1, 9])
def test_moe_on_bf16_blobs_equals_fp32_on_them_widened_in_either_layout(cpu, T):
    check_bf16_is_fp32_widened(cpu, T)


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":")[1].split()) for line in f
                         if line.startswith("flags")), set())
    except OSError:
        return set()


@needs_compiler
def test_the_avx2_build_computes_the_products_as_the_reference(tmp_path):
    """The kernels built for AVX2 (8 lanes, where this host may have AVX-512's 16) on this
    host: the experts in both layouts and the linear product match torch, bf16 gives fp32's
    bits on the weights widened, and a clamped SwiGLU with biases and a last vector only
    partly full matches the format's reference. (The portable 4-lane build, -march=x86-64,
    passes the same checks but takes GCC 90 s to compile: not run here.)"""
    import platform
    import subprocess

    from services.engine.cache.formats import DenseFormat
    from tests.engine.test_expert_mlp import GPT_OSS, reference

    if platform.machine() != "x86_64" or not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("the AVX2 build runs on x86-64 hosts with AVX2 and FMA")
    lib = tmp_path / "kernels-avx2.so"
    flags = ["-march=haswell" if f.startswith("-march") else f for f in kernels.FLAGS]
    subprocess.run([kernels.find_compiler(), *flags, "-o", str(lib), str(kernels.SOURCE)],
                   check=True, capture_output=True)
    cpu = kernels.CpuKernels(lib)
    for T in (1, 5, 40):
        for weights in ("fp32", "fp32_io"):
            check_experts(cpu, T, weights)
        check_bf16_is_fp32_widened(cpu, T)
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(100, 96, generator=g), torch.randn(5, 96, generator=g)
    torch.testing.assert_close(cpu.linear(x, w), x @ w.t(), rtol=1e-5, atol=1e-5)
    D, Fs, E = 128, 60, 6  # F = 60: the activation's last vector partly full
    for inputs_major in (False, True):
        fmt = DenseFormat(D, Fs, torch.float32, GPT_OSS, inputs_major=inputs_major)
        blobs = torch.zeros(E, fmt.numel)
        for blob in blobs:
            fmt.pack(torch.randn(Fs, D, generator=g) * 0.1, torch.randn(Fs, D, generator=g) * 0.1,
                     torch.randn(D, Fs, generator=g) * 0.1, blob)
            fmt.biases(blob).copy_(torch.randn(fmt.bias_numel, generator=g))
        x = torch.randn(7, D, generator=g)
        top_idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(7)])
        top_w = torch.rand(7, 2, generator=g)
        y = cpu.moe(x, top_idx, top_w, np.array([b.data_ptr() for b in blobs]), Fs, 2,
                    weights=fmt.kernel_weights, mlp=GPT_OSS, bias_at=fmt.bias_at)
        want = torch.zeros(7, D)
        for t in range(7):
            for k in sorted(range(2), key=lambda k: int(top_idx[t, k])):
                want[t] += top_w[t, k] * reference(fmt, blobs[int(top_idx[t, k])], x[t:t + 1])[0]
        torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


@pytest.mark.parametrize("weights", ["fp32", "fp32_io"])
@pytest.mark.parametrize("T", [1, 8])
def test_moe_gives_the_same_bits_with_any_number_of_threads(cpu, T, weights):
    """Whole experts a unit (four or more a thread) or a matrix / a share of down's rows a
    unit: the same sums in the same order. At one row 8 experts are whole units on 1 and 2
    threads and finer ones on 3; at eight rows ~42 experts are whole units on each."""
    Fs = 128
    _, _, addr, x, top_idx, top_w = random_moe(10 + T, T, 256, Fs, 64, 8,
                                               weights.endswith("_io"))
    before = torch.get_num_threads()
    try:
        ys = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            ys.append(cpu.moe(x, top_idx, top_w, addr, Fs, 2, weights=weights))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(ys[0], ys[1]) and torch.equal(ys[0], ys[2])


@pytest.mark.parametrize("renormalize", [True, False])
def test_router_matches_torch_topk(cpu, renormalize):
    g = torch.Generator().manual_seed(3)
    x, router_t = torch.randn(11, 64, generator=g), torch.randn(64, 32, generator=g)
    top_idx, top_w, counts = cpu.router(x, router_t, 6, renormalize)
    probs = torch.softmax(x @ router_t, dim=-1)
    want_w, want_idx = torch.topk(probs, 6, dim=-1)
    if renormalize:
        want_w = want_w / want_w.sum(dim=-1, keepdim=True)
    assert torch.equal(top_idx, want_idx)
    torch.testing.assert_close(top_w, want_w, rtol=1e-5, atol=1e-6)
    assert counts.tolist() == torch.bincount(want_idx.flatten(), minlength=32).tolist()


def test_rms_norm_and_qk_norm_rope_match_torch(cpu):
    g = torch.Generator().manual_seed(4)
    T, H, G, Hd = 5, 4, 2, 16
    x, w = torch.randn(T, 48, generator=g), torch.rand(48, generator=g)
    torch.testing.assert_close(cpu.rms_norm(x, w, 1e-6),
                               (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) * w)
    qkv = torch.randn(T, (H + 2 * G) * Hd, generator=g)
    q_norm, k_norm = torch.rand(Hd, generator=g), torch.rand(Hd, generator=g)
    pos = torch.tensor([0, 3, 7, 8, 20])
    inv = 1.0 / 10000 ** (torch.arange(0, Hd, 2).float() / Hd)
    freqs = torch.outer(torch.arange(32).float(), inv)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    q, k, v = qkv.split([H * Hd, G * Hd, G * Hd], dim=1)
    want_q = apply_rope(rms_norm(q.reshape(T, H, Hd), q_norm, 1e-6), cos[pos][:, None],
                        sin[pos][:, None])
    want_k = apply_rope(rms_norm(k.reshape(T, G, Hd), k_norm, 1e-6), cos[pos][:, None],
                        sin[pos][:, None])
    want_v = v.clone()
    cpu.qk_norm_rope(qkv, H, G, Hd, q_norm, k_norm, 1e-6, cos, sin, pos)
    got_q, got_k, got_v = qkv.split([H * Hd, G * Hd, G * Hd], dim=1)
    torch.testing.assert_close(got_q.reshape(T, H, Hd), want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k.reshape(T, G, Hd), want_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_v, want_v)


@pytest.mark.parametrize("H, G, Hd, window, with_sinks", [
    (4, 2, 16, 0, False),
    (8, 1, 44, 0, True),  # one KV head: a row's query heads shared among the threads; a tail
    (16, 2, 64, 6, False),  # eight heads read each KV row; a sliding window
])
def test_decode_attention_reads_scattered_blocks_like_sdpa(cpu, H, G, Hd, window, with_sinks):
    g = torch.Generator().manual_seed(5)
    blocks, P = 12, 4
    k_pool, v_pool = (torch.randn(blocks, P, G, Hd, generator=g) for _ in range(2))
    tables = torch.tensor([[7, 2, 9, 0], [3, 0, 0, 0], [11, 5, 1, 4]])
    lengths = torch.tensor([10, 3, 16])
    q = torch.randn(3, H, Hd, generator=g)
    sinks = torch.randn(H, generator=g) if with_sinks else None
    out = cpu.decode_attention(q, k_pool, v_pool, tables, lengths, 16, sinks, window)
    for r in range(3):
        n = int(lengths[r])
        first = max(0, n - window) if window else 0
        k = k_pool[tables[r]].reshape(-1, G, Hd)[first:n]  # [n', G, Hd]
        v = v_pool[tables[r]].reshape(-1, G, Hd)[first:n]
        for h in range(H):
            kv = h // (H // G)
            scores = k[:, kv] @ q[r, h] * Hd**-0.5  # [n']
            if sinks is not None:
                scores = torch.cat([scores, sinks[h:h + 1]])
            probs = torch.softmax(scores, dim=0)[:len(k)]
            torch.testing.assert_close(out[r, h], probs @ v[:, kv], rtol=1e-5, atol=1e-5)
    alone = cpu.decode_attention(q[1:2].clone(), k_pool, v_pool, tables[1:2].clone(),
                                 lengths[1:2].clone(), 3, sinks, window)
    assert torch.equal(alone[0], out[1])


def decode_logits(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Logits of `steps` batched greedy decode steps after one prefill step."""
    drive = SequenceDriver(runner)
    seqs = [drive.start(p, max_num_tokens=len(p) + steps + 1) for p in prompts]
    out = drive.run([(s, s.num_tokens) for s in seqs])
    history = []
    for _ in range(steps):
        out = drive.decode_batch(seqs, [int(lg.argmax()) for lg in out])
        history.append(torch.stack(out))
    for s in seqs:
        drive.release(s)
    return history


@needs_compiler
def test_fused_decode_layer_equals_the_per_op_kernels(demo_dir):
    runner = ModelRunner(demo_dir, device_memory_bytes=2**40, reserved_bytes=0)
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 3, 17, 18, 19, 20, 21]]
    assert runner.model.fusable
    fused = decode_logits(runner, prompts, 6)
    runner.model.fusable = False  # the per-op path: strata_linear, strata_router, ...
    per_op = decode_logits(runner, prompts, 6)
    assert all(torch.equal(a, b) for a, b in zip(fused, per_op, strict=True))


@needs_compiler
def test_a_decode_step_gives_the_same_bits_with_any_number_of_threads(demo_dir):
    """How a step's work is shared never changes a row's arithmetic: a small layer's attention
    half split by rows among the threads, its experts a whole one a unit or finer units (by how
    many there are per thread), or all on one thread: the same logits, bit for bit, with 1, 2
    and 3 OpenMP threads, at three rows and at one."""
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 3, 17, 18, 19, 20, 21]]
    before = torch.get_num_threads()
    runs = {}
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)  # the kernels share torch's OpenMP pool
            runner = ModelRunner(demo_dir, device_memory_bytes=2**40, reserved_bytes=0)
            runner.fill_cache(runner.layer_order_pairs())
            runs[threads] = decode_logits(runner, prompts, 4) + decode_logits(runner, prompts[:1], 4)
    finally:
        torch.set_num_threads(before)
    for threads in (2, 3):
        assert all(torch.equal(a, b) for a, b in zip(runs[1], runs[threads], strict=True))


@needs_compiler
def test_kernels_off_gives_the_same_greedy_tokens(demo_dir):
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42]]
    on = decode_logits(ModelRunner(demo_dir, device_memory_bytes=2**40, reserved_bytes=0),
                       prompts, 8)
    runner = ModelRunner(demo_dir, device_memory_bytes=2**40, reserved_bytes=0,
                         cpu_kernels="off")
    assert runner.backend.cpu is None
    assert not runner.cache.cpu_kernels and not runner.model.fusable
    off = decode_logits(runner, prompts, 8)
    assert kernels.load() is not None  # other runners still get them
    for a, b in zip(on, off, strict=True):
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_failed_build_falls_back_to_torch_in_auto_and_fails_loudly_when_on(
        monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("STRATA_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(kernels.shutil, "which", lambda name: None)
    kernels.forget()  # build afresh, under the broken environment
    try:
        with caplog.at_level(logging.WARNING, logger="strata.engine"):
            assert kernels.load("auto") is None
        assert "CPU kernels unavailable (no C compiler found" in caplog.text
        assert "--cpu-kernels off" in caplog.text
        with pytest.raises(kernels.KernelBuildError, match="--cpu-kernels on"):
            kernels.load("on")
        with pytest.raises(ValueError, match="auto, on, off"):
            kernels.load("fast")
    finally:
        kernels.forget()


@needs_compiler
def test_build_is_cached_by_source_and_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("STRATA_KERNEL_CACHE", str(tmp_path))
    first = kernels.build()
    assert first.parent == tmp_path and first.name.startswith("cpu_kernels-")
    mtime = first.stat().st_mtime_ns
    assert kernels.build() == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left behind
    assert kernels.CpuKernels(first).linear(torch.ones(1, 4), torch.ones(4, 4)).tolist() == [
        [4.0] * 4]


@needs_compiler
def test_a_short_prompt_in_one_step_equals_it_token_by_token(demo_dir):
    """A short prompt's rows attend as decode rows do (each by table over its own causal
    length), so prefilling it in one step gives the logits of feeding it one token a step, bit
    for bit; past `paged_span_pairs` a chunk takes SDPA, equal within fp32 rounding."""
    runner = ModelRunner(demo_dir, device_memory_bytes=2**40, reserved_bytes=0)
    drive = SequenceDriver(runner)
    prompt = [(7 * i + 3) % 200 + 4 for i in range(24)]

    def last_logits(chunk: int) -> torch.Tensor:
        seq = drive.start(prompt)
        while seq.num_computed < seq.num_tokens:
            logits = drive.prefill(seq, chunk)
        drive.release(seq)
        return logits

    one_step, by_token = last_logits(len(prompt)), last_logits(1)
    assert torch.equal(one_step, by_token)
    limit = runner.model.backend.paged_span_pairs
    try:
        runner.model.backend.paged_span_pairs = 0  # every multi-row span in SDPA
        sdpa = last_logits(len(prompt))
    finally:
        runner.model.backend.paged_span_pairs = limit
    torch.testing.assert_close(sdpa, one_step, rtol=1e-4, atol=1e-4)
    assert not torch.equal(sdpa, one_step)  # (so the limit chose the path)


@needs_compiler
def test_a_step_of_every_layer_in_one_call_equals_the_layer_by_layer_path(demo_dir):
    """With every pair resident a step of decode rows and short prompts runs all layers in one
    C call and the cache looks its experts up after it: the same logits, bit for bit, and the
    same lookups, hits, routing counts and policy state as looking them up layer by layer."""
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 3, 17, 18, 19, 20, 21]]
    runs = []
    for one_call in (True, False):
        runner = ModelRunner(demo_dir, device_memory_bytes=2**40, reserved_bytes=0)
        runner.fill_cache(runner.layer_order_pairs())
        cache = runner.cache
        if not one_call:
            cache.step_table = lambda: None
        tables: list[np.ndarray] = []
        finish = cache.finish_table_step
        cache.finish_table_step = (
            lambda layers, top, counts, _f=finish, _seen=tables: (
                _seen.append(top), _f(layers, top, counts)))
        logits = decode_logits(runner, prompts, 6)
        # every step: the prompts' (short spans attend as decode rows do) and 6 decode steps
        assert len(tables) == (7 if one_call else 0)
        runs.append((logits, cache.decode, cache.routing_counts.copy(),
                     cache.residency._order._key.copy()))
    (a, counts_a, routed_a, keys_a), (b, counts_b, routed_b, keys_b) = runs
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert counts_a == counts_b and counts_a.hits == counts_a.lookups > 0
    assert np.array_equal(routed_a, routed_b) and keys_a == keys_b


@needs_compiler
def test_a_decode_step_reads_experts_by_table_slot_or_host_store(demo_dir, tmp_path):
    """The address table points each pair at its slot, a pair with none at its host blob (read
    in place, as a CUDA graph replay reads it); predictions keep the layers apart (prefetch
    with pairs left to fetch, a routing trace)."""
    runner = ModelRunner(demo_dir, device_memory_bytes=2**40, reserved_bytes=0)
    pairs = runner.layer_order_pairs()
    runner.fill_cache(pairs[:-1])
    runner.cache.begin_step(1, False)
    table = runner.cache.step_table()
    assert table is not None and table.addresses.shape == (len(runner.model.layers),
                                                           runner.config.num_experts)
    base, blob = runner.cache.pool.slots.data_ptr(), runner.cache.format.blob_bytes
    layer, expert = pairs[0]
    slot = runner.cache.residency.lookup((layer, expert))
    assert table.addresses[layer, expert] == base + slot * blob
    last = pairs[-1]
    assert table.addresses[last] == runner.cache.host.blob(last).data_ptr()
    prefetching = ModelRunner(demo_dir, device_memory_bytes=2**40, reserved_bytes=0,
                              prefetch=True)
    prefetching.fill_cache(pairs[:-1])
    prefetching.cache.begin_step(1, False)
    assert prefetching.cache.step_table() is None
    recording = ModelRunner(demo_dir, device_memory_bytes=2**40, reserved_bytes=0,
                            record_routing=tmp_path / "trace.bin")
    recording.cache.begin_step(1, False)
    assert recording.cache.step_table() is None


@needs_compiler
def test_table_steps_with_misses_equal_layer_by_layer_steps(demo_dir):
    """A third of the pairs resident: decode steps by table (misses read in place, looked up
    after the step) give the logits, lookups and hits of steps placed layer by layer."""
    runs = []
    for placement in ("exact", "copy"):  # copy: every miss staged before its layer reads it
        runner = ModelRunner(demo_dir, cache_slots=load_model_config(demo_dir).total_pairs // 3,
                             reserved_bytes=0, placement=placement, prefetch=False)
        runner.fill_cache(runner.layer_order_pairs()[::2])
        drive = SequenceDriver(runner)
        seq = drive.start([5, 17, 3, 99])
        rows = [drive.prefill(seq)] + [drive.decode(seq, t) for t in (7, 8, 9, 10)]
        runs.append((torch.stack(rows), runner.cache.decode))  # (prefill: its own counters)
    (by_table, d), (by_layer, d_layer) = runs
    assert torch.equal(by_table, by_layer)
    assert (d.lookups, d.hits, d.spilled) == (d_layer.lookups, d_layer.hits, d_layer.spilled)
    assert d.spilled > 0 and d.reasons == {"host:table": d.reasons["host:table"]}
    assert d_layer.reasons.keys() == {"copy:forced"}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2,
                    reason="counts threads in /proc; needs 2 cores for a team with a worker")
def test_release_thread_pool_frees_the_calling_threads_openmp_workers():
    """core.Engine.start frees the loading thread's OpenMP workers (libgomp throttles every
    barrier once it manages more threads than cores); here a fresh thread opens a parallel
    region, then releases its pool: its workers exit."""
    seen = []

    def run():
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            before = set(os.listdir("/proc/self/task"))
            torch.ones(1 << 22).sum()  # a parallel region: this thread's pool gets a worker
            seen.append(set(os.listdir("/proc/self/task")) - before)
            seen.append(kernels.release_thread_pool())
            deadline = time.monotonic() + 5.0  # the workers exit on their own, soon after
            while seen[0] & set(os.listdir("/proc/self/task")) and time.monotonic() < deadline:
                time.sleep(0.01)
            seen.append(set(os.listdir("/proc/self/task")))
        finally:
            torch.set_num_threads(threads)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    workers, released, after = seen
    assert workers and released and not workers & after
