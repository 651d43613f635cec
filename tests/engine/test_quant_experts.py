"""Quantized experts (--expert-dtype int8|int4): round-trip error bounds, the packed int4 layout,
exact slot sizes, quality against fp32 on the demo model, greedy invariance across cache sizes,
and the capacity arithmetic (auto-sizer, `strata plan`) on the real slot size."""

from __future__ import annotations

import json

import pytest
import torch

from services.bench import engine_bench, plan_cli
from services.bench.quant_bench import position_logits
from services.common.settings import ConfigError, resolve
from services.engine.cache.formats import DenseFormat, expert_format
from services.engine.cache.layout import ExpertLayout, swiglu
from services.engine.cache.policy import PolicySpec
from services.engine.config import SETTINGS
from services.engine.model.checkpoint import CheckpointReader
from services.engine.model.quant import (
    QUANT_SPECS,
    QuantExpertLayout,
    QuantMatrices,
    pack_int4,
    quantize,
    unpack_int4,
)
from services.engine.runner import ModelRunner
from tests.engine.conftest import fixed_bytes
from tests.engine.test_runner import PROMPT, greedy

INT8, INT4 = QUANT_SPECS["int8"], QUANT_SPECS["int4"]
CPU = torch.device("cpu")
TEXT = (
    "The quick brown fox jumps over the lazy dog while the old river keeps running to the "
    "sea. Memory bandwidth, not arithmetic, bounds the decode of a sparse mixture of experts."
)


def weights(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * 0.02


@pytest.mark.parametrize("spec", [INT8, INT4], ids=["int8", "int4"])
def test_round_trip_error_is_at_most_half_a_step(spec):
    w = weights(3, 128, 48)
    w[1, :32, 5] = 0.0  # an all-zero group must come back as zeros
    q, scales = quantize(w, spec)
    G = 128 if spec.group_size == 0 else spec.group_size
    assert q.dtype == torch.int8 and q.abs().max() <= spec.qmax
    assert scales.shape == (3, 128 // G, 48) and scales.dtype == spec.scale_dtype
    step = scales.float().repeat_interleave(G, dim=1)  # [3, 128, 48]
    back = q.float() * step
    assert ((back - w).abs() <= step / 2 * (1 + 1e-3) + 1e-12).all()
    assert (back[1, :32, 5] == 0).all()
    # the error is a small fraction of the weights: int8 ~0.4%, int4 ~7% of the group max
    rel = (back - w).norm() / w.norm()
    assert rel < (0.01 if spec.bits == 8 else 0.12), rel


def test_int4_packs_two_rows_per_byte_offset_binary():
    q = torch.tensor([[-7, 0], [1, 7], [-1, 3], [5, -8 + 1]], dtype=torch.int8)  # [K=4, N=2]
    packed = pack_int4(q)
    assert packed.shape == (2, 2) and packed.dtype == torch.uint8
    for r in range(2):
        for n in range(2):  # row r in the low nibble, row r + K/2 in the high one, each + 8
            assert int(packed[r, n]) == (int(q[r, n]) + 8) | ((int(q[r + 2, n]) + 8) << 4)
    nibbles = unpack_int4(packed, torch.empty(4, 2, dtype=torch.uint8))
    assert torch.equal(nibbles.to(torch.int8) - 8, q)


@pytest.mark.parametrize("shape", [(2, 64, 32), (3, 6, 5), (1, 2, 1)])
def test_unpack_word_path_equals_byte_path(shape):
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    B, half, N = shape
    fast = unpack_int4(packed, torch.empty(B, 2 * half, N, dtype=torch.uint8))
    slow = torch.cat([packed & 0x0F, packed >> 4], dim=1)
    assert torch.equal(fast, slow)


@pytest.mark.parametrize("spec", [INT8, INT4], ids=["int8", "int4"])
def test_quantized_matmul_matches_its_dequantized_weights(spec):
    m = QuantMatrices(spec, 2, 128, 64)
    blob = torch.zeros(m.nbytes, dtype=torch.uint8)
    w = weights(2, 128, 64, seed=2)
    m.pack(w, blob)
    deq = m.dequantize(blob, torch.empty(2, 128, 64))
    x = torch.randn(5, 128)
    scratch = m.scratch(CPU, torch.float32)
    y = m.matmul(x, blob, scratch)  # [2, 5, 64]
    torch.testing.assert_close(y, torch.bmm(x.expand(2, 5, 128), deq), atol=1e-5, rtol=1e-4)
    assert torch.equal(m.matmul(x, blob, scratch), y)  # scratch reuse leaves no trace


def test_slot_sizes_follow_the_dtype():
    D, F = 512, 256  # the bench preset's expert
    fp32, bf16 = ExpertLayout(D, F).blob_bytes(torch.float32), 3 * D * F * 2
    int8 = expert_format(D, F, torch.float32, "int8").blob_bytes
    int4 = expert_format(D, F, torch.float32, "int4").blob_bytes
    assert fp32 == 3 * D * F * 4
    assert int8 == 3 * D * F + 4 * (2 * F + D)  # one fp32 scale per output column
    assert int4 == 3 * D * F // 2 + 2 * (2 * (D // 32) * F + (F // 32) * D)  # fp16 per 32
    assert 0.5 < int8 / bf16 < 0.51 and 0.28 < int4 / bf16 < 0.29
    assert expert_format(D, F, torch.bfloat16, "int4").blob_bytes == int4  # not the compute dtype
    assert expert_format(D, F, torch.bfloat16).blob_bytes == bf16
    assert isinstance(expert_format(D, F, torch.float32), DenseFormat)
    with pytest.raises(ValueError, match="int3"):
        expert_format(D, F, torch.float32, "int3")


@pytest.mark.parametrize("expert_dtype", ["int8", "int4"])
def test_layout_packs_checkpoint_weights_and_runs_them(tiny_dir, expert_dtype):
    layout = QuantExpertLayout(64, 32, QUANT_SPECS[expert_dtype])
    gate, up, down = CheckpointReader(tiny_dir).expert_weights(1, 3, 64, 32)
    blob = torch.zeros(layout.numel, dtype=torch.uint8)
    layout.pack(gate, up, down, blob)
    gate_up_t, down_t = layout.views(blob)  # dequantized, logical orientation
    # RMS error of a symmetric absmax grid on Gaussian weights: ~0.5% (int8), ~9% (int4)
    tol = 0.015 if expert_dtype == "int8" else 0.12
    want_gate_up = torch.cat([gate.t(), up.t()], 1)
    assert (gate_up_t - want_gate_up).norm() / want_gate_up.norm() < tol
    assert (down_t - down.t()).norm() / down.norm() < tol
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(3))
    y = layout.forward(x, blob)
    torch.testing.assert_close(y, swiglu(x, gate_up_t, down_t), atol=1e-5, rtol=1e-4)
    exact = ExpertLayout(64, 32)
    fp32 = torch.empty(exact.numel)
    exact.pack(gate, up, down, fp32)
    assert (y - exact.forward(x, fp32)).norm() / y.norm() < 2.5 * tol


@pytest.mark.parametrize("expert_dtype", ["int8", "int4"])
def test_a_stack_of_experts_dequantizes_in_one_go(tiny_dir, expert_dtype):
    layout = QuantExpertLayout(64, 32, QUANT_SPECS[expert_dtype])
    reader = CheckpointReader(tiny_dir)
    blobs = torch.zeros(5, layout.numel, dtype=torch.uint8)
    for e in range(5):
        layout.pack(*reader.expert_weights(2, e, 64, 32), blobs[e])
    stack = blobs[[4, 0, 2]]  # [3, numel]
    gate_up, down = layout.dequantize_experts(stack)
    assert gate_up.shape == (3, 2, 64, 32) and down.shape == (3, 2, 32, 32)
    for i, e in enumerate((4, 0, 2)):
        gate_up_t, down_t = layout.views(blobs[e])
        assert torch.equal(torch.cat([gate_up[i, 0], gate_up[i, 1]], 1), gate_up_t)
        assert torch.equal(torch.cat([down[i, 0], down[i, 1]], 1), down_t)


def runner(model_dir, slots: int, expert_dtype: str, **kwargs) -> ModelRunner:
    return ModelRunner(
        model_dir,
        cache_slots=slots,
        reserved_bytes=0,
        expert_dtype=expert_dtype,
        **kwargs,
    )


def test_int4_greedy_identical_across_cache_sizes_policies_and_placements(tiny_dir):
    cases = [
        (0, "lru", "exact"),
        (5, "lru", "host"),
        (12, "crf", "copy"),
        (12, "static", "auto"),
        (24, "lfu", "exact"),
    ]
    results = []
    for slots, policy, placement in cases:
        r = runner(
            tiny_dir,
            slots,
            "int4",
            policy=PolicySpec(policy, 0.25),
            placement=placement,
            prefetch=True,
        )
        assert r.slots == slots and r.cache.host.dtype == torch.uint8
        assert r.cache.pool.slots.shape == (slots, r.slot_bytes)
        assert r.fill_cache(r.layer_order_pairs()[::-1]).verified
        seq, tokens, logits = greedy(r, PROMPT)
        if 0 < slots < 24:
            assert 0 < seq.stats.hits < seq.stats.lookups
        results.append((tokens, logits))
    tokens, logits = results[0]
    assert all(t == tokens and torch.equal(lg, logits) for t, lg in results[1:])  # bit-identical


def test_int8_and_int4_agree_with_fp32_on_the_demo_model(demo_dir):
    ids = list(TEXT.encode())  # byte tokenizer: ids are bytes
    logits = {}
    for expert_dtype in ("auto", "int8", "int4"):
        r = ModelRunner(
            demo_dir, device_memory_bytes=2**40, reserved_bytes=0, expert_dtype=expert_dtype
        )
        r.fill_cache(r.layer_order_pairs())
        logits[expert_dtype] = position_logits(r, ids)  # [T, V]
    ref = logits["auto"].argmax(-1)
    agreement = {d: (logits[d].argmax(-1) == ref).float().mean().item() for d in ("int8", "int4")}
    assert agreement["int8"] >= 0.97 and agreement["int4"] >= 0.90, agreement
    usable = slice(0, 259)  # byte and special tokens (the rest is masked vocab padding)
    for d, bound in (("int8", 0.01), ("int4", 0.15)):
        diff = (logits[d][:, usable] - logits["auto"][:, usable]).norm()
        assert diff / logits["auto"][:, usable].norm() < bound, d


def test_auto_sizer_counts_slots_of_the_quantized_size(tiny_dir):
    budget = 40 * 3 * 64 * 32 * 4  # 40 fp32 slots' worth: more than the 24 pairs once quantized
    sizes = {}
    for expert_dtype in ("auto", "int8", "int4"):
        r = ModelRunner(tiny_dir, device_memory_bytes=fixed_bytes(tiny_dir) + budget // 4,
                        reserved_bytes=0, expert_dtype=expert_dtype)
        assert r.slot_bytes == expert_format(64, 32, torch.float32, expert_dtype).blob_bytes
        assert r.slots == min(24, (budget // 4) // r.slot_bytes)
        assert r.cache.host.slot_bytes == r.slot_bytes
        assert r.cache.host.total_bytes == 24 * r.slot_bytes
        sizes[expert_dtype] = r.slots
    assert sizes == {"auto": 10, "int8": 24, "int4": 24}


def test_plan_uses_the_slot_size_of_the_expert_dtype(tiny_dir, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("STRATA_HOME", str(tmp_path))  # no stored fit
    free_mib = 0.25
    rows = {}
    for expert_dtype in ("auto", "int8", "int4"):
        argv = [
            "--model",
            str(tiny_dir),
            "--expert-dtype",
            expert_dtype,
            "--free-mib",
            str(free_mib),
            "--reserved-mib",
            "0",
            "--weights-mib",  # the slot arithmetic alone
            "0",
            "--kv-mib",
            "0",
            "--json",
        ]
        assert plan_cli.plan_main(argv) == 0
        out = json.loads(capsys.readouterr().out)
        slot_bytes = expert_format(64, 32, torch.float32, expert_dtype).blob_bytes
        assert out["inputs"]["slot_bytes"] == slot_bytes
        assert out["inputs"]["expert_dtype"] == expert_dtype
        [row] = out["rows"]
        assert row["slots"] == min(24, int(free_mib * 2**20) // slot_bytes)
        rows[expert_dtype] = row["coverage"]
    assert rows["auto"] < rows["int8"] <= rows["int4"] == 1.0
    assert (
        plan_cli.plan_main(["--slot-bytes", "100", "--pairs", "8", "--expert-dtype", "int4"]) == 2
    )
    assert "needs --model" in capsys.readouterr().err


def test_bench_engine_reads_quantized_expert_bytes(tiny_dir, capsys, monkeypatch):
    monkeypatch.setattr(engine_bench, "BANDWIDTH_BYTES", 16 * 2**20)
    argv = [
        "--model",
        str(tiny_dir),
        "--prompt-tokens",
        "6",
        "--gen-tokens",
        "3",
        "--repeat",
        "1",
        "--expert-dtype",
        "int4",
        "--json",
    ]
    assert engine_bench.main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["expert_dtype"] == "int4" and r["coverage"] == 1.0
    assert r["expert_bytes"] == expert_format(64, 32, torch.float32, "int4").blob_bytes
    assert r["decode_tok_s"] > 0


def test_expert_dtype_setting():
    assert resolve(SETTINGS, environ={})["expert_dtype"] == "auto"
    assert resolve(SETTINGS, environ={"STRATA_EXPERT_DTYPE": "int4"})["expert_dtype"] == "int4"
    with pytest.raises(ConfigError, match="STRATA_EXPERT_DTYPE"):
        resolve(SETTINGS, environ={"STRATA_EXPERT_DTYPE": "int2"})


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_int4_on_cuda_matches_the_host_and_is_exact_across_sizes(tiny_dir):
    layout = QuantExpertLayout(64, 32, QUANT_SPECS["int4"])
    gate, up, down = CheckpointReader(tiny_dir).expert_weights(0, 1, 64, 32)
    blob = torch.zeros(layout.numel, dtype=torch.uint8)
    layout.pack(gate, up, down, blob)
    x = torch.randn(9, 64)
    torch.testing.assert_close(
        layout.forward(x.cuda(), blob.cuda()).cpu(), layout.forward(x, blob), atol=1e-5, rtol=1e-4
    )
    results = []
    for slots in (0, 6, 24):
        r = ModelRunner(
            tiny_dir,
            device="cuda",
            cache_slots=slots,
            reserved_bytes=0,
            expert_dtype="int4",
            placement="exact",
            prefetch=True,
        )
        assert r.cache.host.blobs.is_pinned() and r.slots == slots
        assert r.fill_cache(r.layer_order_pairs()[::-1]).verified
        _, tokens, logits = greedy(r, PROMPT)
        results.append((tokens, logits.cpu()))
    assert all(t == results[0][0] and torch.equal(lg, results[0][1]) for t, lg in results)
