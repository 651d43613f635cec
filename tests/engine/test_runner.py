"""ModelRunner: sizing, coverage-independent greedy output, counters and sequence lifecycle."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from services.common.settings import format_bytes
from services.common.sizing import BudgetError
from services.engine.cache.policy import PolicySpec
from services.engine.driver import SequenceDriver
from services.engine.runner import ContextWindowError, ModelRunner, PromptError, fixed_bytes_of
from tests.engine.conftest import fixed_bytes

PROMPT = "<|im_start|>user\nHow many experts fit in the cache?<|im_end|>\n<|im_start|>assistant\n"
TOTAL_PAIRS = 3 * 8


def runner_with_slots(model_dir, slots: int, **kwargs) -> ModelRunner:
    """A runner whose budget the auto-sizer turns into exactly `slots` slots."""
    slot_bytes = 3 * 64 * 32 * 4
    reserved = 1 << 20
    fixed = fixed_bytes(model_dir, **{k: v for k, v in kwargs.items() if k.startswith("kv_")})
    return ModelRunner(
        model_dir,
        device_memory_bytes=fixed + reserved + slots * slot_bytes + 100,
        reserved_bytes=reserved,
        **kwargs,
    )


def greedy(runner: ModelRunner, prompt: str, n: int = 24):
    drive = SequenceDriver(runner)
    seq = drive.start(runner.tokenizer.encode(prompt))
    logits, out = drive.prefill(seq), []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = drive.decode(seq, out[-1])
    drive.release(seq)
    drive.close()
    return seq, out, logits


def greedy_by_cache_size(model_dir, slot_counts, prompt: str, n: int = 8, **kwargs
                         ) -> list[tuple[list[int], torch.Tensor]]:
    """(greedy tokens, last logits) of a runner per slot count, each cache filled first
    (in reverse layer order) — what "identical across cache sizes" compares."""
    results = []
    for slots in slot_counts:
        runner = ModelRunner(model_dir, cache_slots=slots, reserved_bytes=0, **kwargs)
        runner.fill_cache(runner.layer_order_pairs()[::-1])
        _, tokens, logits = greedy(runner, prompt, n=n)
        results.append((tokens, logits))
    return results


def test_sizing_and_fill_logs(tiny_dir, caplog):
    caplog.set_level(logging.INFO, logger="strata.engine")
    runner = runner_with_slots(tiny_dir, 6)
    assert (runner.slots, runner.total_pairs, runner.slot_bytes) == (
        6,
        TOTAL_PAIRS,
        3 * 64 * 32 * 4,
    )
    assert runner.cache_size.coverage == 6 / 24
    assert runner.model_name == "tiny-demo" and len(runner.fingerprint) == 16
    c = runner.config
    assert (c.num_layers, c.num_experts, c.experts_per_token, c.context_window, c.vocab_size) == (
        3,
        8,
        2,
        512,
        320,
    )
    assert runner.layer_order_pairs()[:3] == [(0, 0), (0, 1), (0, 2)]
    report = runner.fill_cache(runner.layer_order_pairs(), source="profile")
    assert report.filled == 6 and report.verified
    text = caplog.text
    assert "expert cache auto: " in text and "-> 6 slots" in text
    assert "pre-filled 6 of 6 slots from the profile in " in text and "slot 0 verified" in text
    assert "loading tiny-demo" in text


def test_cpu_requires_a_memory_budget(tiny_dir):
    with pytest.raises(ValueError, match="device_memory_bytes"):
        ModelRunner(tiny_dir)


def test_the_budget_rule_subtracts_weights_kv_draft_and_reserve_once(tiny_dir, caplog):
    """slots = (budget - weights - KV - draft - reserve) // slot_bytes, with the weights and
    KV the runner really holds, each term in the start-up line; `strata plan --model` counts
    the same terms from the checkpoint alone."""
    caplog.set_level(logging.INFO, logger="strata.engine")
    slot, reserve, draft = 3 * 64 * 32 * 4, 1 << 20, 300_000
    budget = 5 << 20
    runner = ModelRunner(tiny_dir, device_memory_bytes=budget, reserved_bytes=reserve,
                         draft_head_bytes=draft, kv_memory_bytes=3 << 20)
    size = runner.cache_size
    assert size.weight_bytes == runner.model.weight_bytes() > 0
    assert size.kv_bytes == runner.kv.nbytes == 3 << 20  # whole blocks of --kv-memory
    want = (budget - size.weight_bytes - size.kv_bytes - draft - reserve) // slot
    assert 0 < want < TOTAL_PAIRS and runner.slots == want
    assert (f"expert cache auto: {format_bytes(budget)} budget - "
            f"{format_bytes(size.weight_bytes)} weights - {format_bytes(size.kv_bytes)} KV - "
            f"{format_bytes(draft)} draft head - {format_bytes(reserve)} reserved = ") in caplog.text
    assert f"-> {want} slots of {format_bytes(slot)}" in caplog.text
    probe = ModelRunner(tiny_dir, cache_slots=0, reserved_bytes=0)  # the default KV pool
    assert fixed_bytes_of(tiny_dir) == (probe.cache_size.weight_bytes, probe.cache_size.kv_bytes)


def test_a_budget_without_room_or_cache_slots_that_do_not_fit_stop_the_start(tiny_dir):
    fixed = fixed_bytes(tiny_dir)
    with pytest.raises(BudgetError, match="does not hold the engine without any cache: "
                       r".* weights - .* KV - 1.00 MiB reserved = -"):
        ModelRunner(tiny_dir, device_memory_bytes=fixed, reserved_bytes=1 << 20)
    room = fixed + 6 * 3 * 64 * 32 * 4
    assert ModelRunner(tiny_dir, device_memory_bytes=room, reserved_bytes=0,
                       cache_slots=6).slots == 6
    with pytest.raises(BudgetError, match="--cache-slots 7 needs .* holds 6 slots"):
        ModelRunner(tiny_dir, device_memory_bytes=room, reserved_bytes=0, cache_slots=7)


def test_cache_slots_size_the_cache_without_a_budget_on_cpu(tiny_dir, caplog):
    caplog.set_level(logging.INFO, logger="strata.engine")
    assert ModelRunner(tiny_dir, cache_slots=5).slots == 5
    assert "expert cache --cache-slots: " in caplog.text and "-> 5 slots" in caplog.text
    assert ModelRunner(tiny_dir, cache_slots=10**6).slots == TOTAL_PAIRS


@pytest.mark.parametrize("prompt", [PROMPT, "a different, longer prompt " * 6])
def test_greedy_identical_at_any_coverage(tiny_dir, prompt):
    results = {}
    for slots in (0, 6, TOTAL_PAIRS):  # 0%, 25%, 100% coverage
        runner = runner_with_slots(tiny_dir, slots)
        assert runner.slots == slots
        runner.fill_cache(runner.layer_order_pairs()[::-1])
        seq, tokens, logits = greedy(runner, prompt)
        s = seq.stats
        assert s.hits + s.spilled == s.lookups == 24 * 3 * 2  # tokens x MoE layers x routed
        assert s.prefill_lookups == seq.prompt_len * 3 * 2
        if slots == 0:
            assert s.hits == 0 and s.prefill_hits == 0
        elif slots == TOTAL_PAIRS:
            assert s.spilled == 0 and s.prefill_hits == s.prefill_lookups
        else:
            assert 0 < s.hits < s.lookups
        results[slots] = (tokens, logits)
    (t0, l0), (t25, l25), (t100, l100) = results.values()
    assert t0 == t25 == t100
    assert torch.equal(l0, l25) and torch.equal(l0, l100)  # bit-identical, not just close


@pytest.fixture(scope="module")
def reference_greedy(tiny_dir):
    """Greedy tokens and final logits with no cache at all (every expert from the host)."""
    _, tokens, logits = greedy(runner_with_slots(tiny_dir, 0), PROMPT)
    return tokens, logits


@pytest.mark.parametrize("policy", ["static", "lru", "lfu", "crf"])
def test_greedy_identical_for_every_policy_size_and_placement(tiny_dir, reference_greedy, policy):
    from services.engine.cache.policy import PolicySpec

    want_tokens, want_logits = reference_greedy
    cases = [(5, 0.25, "exact", True), (12, 0.5, "copy", False), (12, 0.0, "host", True),
             (TOTAL_PAIRS, 0.25, "auto", True)]
    for slots, pinned, placement, prefetch in cases:
        runner = runner_with_slots(tiny_dir, slots, policy=PolicySpec(policy, pinned),
                                   placement=placement, prefetch=prefetch)
        runner.fill_cache(runner.layer_order_pairs()[::-1])
        seq, tokens, logits = greedy(runner, PROMPT)
        assert tokens == want_tokens and torch.equal(logits, want_logits), (slots, placement)
        d = seq.stats.decode
        assert d.hits + d.misses_host + d.misses_copied == d.lookups
        if placement in ("host", "copy"):
            assert (d.misses_host if placement == "host" else d.misses_copied) == d.spilled
            assert set(d.reasons) <= {f"{placement}:forced"}
        if prefetch and policy != "static" and slots < TOTAL_PAIRS:
            assert d.predicted > 0 and 0 < d.prefetch_precision <= 1
        if slots >= TOTAL_PAIRS:  # every pair resident: nothing to prefetch, so no prediction
            assert d.predicted == 0


def test_routing_counts_match_lookups(tiny_dir):
    runner = runner_with_slots(tiny_dir, 0)
    runner.take_routing_counts()
    seq, _, _ = greedy(runner, PROMPT, n=5)
    counts = runner.take_routing_counts()
    assert counts.shape == (3, 8) and counts.dtype == np.int64
    assert counts.sum() == seq.stats.prefill_lookups + seq.stats.lookups
    assert (counts.sum(axis=1) == seq.num_tokens * 2).all()  # every token, 2 routed per layer
    assert runner.take_routing_counts().sum() == 0


def test_sequence_lifecycle_and_limits(tiny_dir):
    runner = runner_with_slots(tiny_dir, 0)
    drive = SequenceDriver(runner)
    seq = drive.start([1, 2, 3], max_num_tokens=5)
    assert seq.num_tokens == 3 and seq.max_num_tokens == 5
    assert drive.prefill(seq).shape == (320,)
    logits = drive.decode(seq, 4)
    assert seq.num_tokens == 4
    assert torch.isinf(logits[259:]).all() and torch.isfinite(logits[:259]).all()
    drive.decode(seq, 5)
    with pytest.raises(ContextWindowError):
        drive.decode(seq, 6)
    assert seq.num_tokens == 5  # the refused token was not appended
    other = drive.start([7, 8])
    drive.prefill(other)
    drive.release(other)
    with pytest.raises(AssertionError, match="released"):
        drive.decode(other, 9)
    with pytest.raises(AssertionError, match="before prefill"):
        drive.decode(drive.start([1]), 2)  # an engine bug, not a client error
    with pytest.raises(ContextWindowError, match="context window 512"):
        drive.start([1] * 513)
    with pytest.raises(PromptError, match="empty"):
        drive.start([])
    with pytest.raises(PromptError, match="outside the vocabulary"):
        drive.start([1, 320])


def test_two_sequences_interleaved_do_not_interfere(tiny_dir):
    runner = runner_with_slots(tiny_dir, 8)
    _, alone, _ = greedy(runner, PROMPT, n=6)
    drive = SequenceDriver(runner)
    a = drive.start(runner.tokenizer.encode(PROMPT))
    b = drive.start(runner.tokenizer.encode("something else entirely"))
    la, lb = drive.prefill(a), drive.prefill(b)
    out = []
    for _ in range(6):
        out.append(int(la.argmax()))
        la = drive.decode(a, out[-1])
        lb = drive.decode(b, int(lb.argmax()))
    assert out == alone


def test_chunked_prefill_matches_one_pass(tiny_dir):
    runner = runner_with_slots(tiny_dir, 12)
    drive = SequenceDriver(runner)
    ids = runner.tokenizer.encode(PROMPT * 3)
    whole = drive.start(ids)
    want = drive.prefill(whole)
    chunked = drive.start(ids)
    while chunked.num_computed < chunked.num_tokens:
        got = drive.prefill(chunked, max_tokens=17)
    assert chunked.stats.prefill_lookups == whole.stats.prefill_lookups
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    token = int(want.argmax())
    torch.testing.assert_close(
        drive.decode(chunked, token), drive.decode(whole, token), atol=1e-5, rtol=0
    )


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("placement", ["copy", "host", "exact"])
def test_cuda_cache_paths(tiny_dir, placement):
    _, want, want_logits = greedy(runner_with_slots(tiny_dir, 0), PROMPT)
    results = []
    for slots in (0, 6, TOTAL_PAIRS):
        runner = ModelRunner(
            tiny_dir,
            device="cuda",
            cache_slots=slots,
            reserved_bytes=0,
            placement=placement,
        )
        assert runner.cache.host.blobs.is_pinned()
        assert runner.fill_cache(runner.layer_order_pairs()).verified
        seq, tokens, logits = greedy(runner, PROMPT)
        assert seq.stats.hits + seq.stats.spilled == seq.stats.lookups
        torch.testing.assert_close(logits.cpu(), want_logits, atol=1e-4, rtol=0)
        results.append((tokens, logits.cpu()))
    assert all(tokens == want for tokens, _ in results)
    if placement != "host" or runner.cache.host_exact:  # the device computes every miss too
        # (the kernel reads host-placed blobs in place): bit-identical at any coverage
        assert all(torch.equal(logits, results[0][1]) for _, logits in results)


@pytest.mark.parametrize("cpu_kernels", ["auto", "off"])
@pytest.mark.parametrize("placement", ["host", "copy"])
def test_bf16_greedy_output_is_identical_across_cache_sizes_and_placements(tiny_bf16_dir,
                                                                            placement,
                                                                            cpu_kernels):
    """Served in bf16 (as stored): every cache size, policy and placement gives the same
    logits bit for bit, and the runner holds bf16 in the host store and the slots."""
    results = []
    for slots, policy in ((0, "static"), (6, "lru"), (12, "crf"), (24, "static")):
        runner = ModelRunner(tiny_bf16_dir, cache_slots=slots, reserved_bytes=0, policy=PolicySpec(policy, 0.25),
                             placement=placement, prefetch=True, cpu_kernels=cpu_kernels)
        assert runner.weight_dtype == torch.bfloat16 and runner.slots == slots
        assert runner.cache.host.blobs.dtype == runner.cache.pool.slots.dtype == torch.bfloat16
        runner.fill_cache(runner.layer_order_pairs()[::-1])
        _, tokens, logits = greedy(runner, PROMPT, n=12)
        results.append((tokens, logits))
    assert all(t == results[0][0] and torch.equal(lg, results[0][1]) for t, lg in results)


def test_a_model_larger_than_host_memory_is_refused_before_loading(tiny_dir, caplog):
    """The host store and the non-expert weights are set against the host's memory before
    anything is loaded: the error states both sizes, what is available, and what would fit."""
    from services.common.sizing import HostMemoryError

    runner = ModelRunner(tiny_dir, cache_slots=0, reserved_bytes=0)
    host = runner.cache.host.total_bytes
    weights = fixed_bytes_of(tiny_dir, runner.weight_dtype)[0]
    runner.close()
    caplog.set_level(logging.INFO, logger="strata.engine")
    caplog.clear()
    with pytest.raises(HostMemoryError) as e:
        ModelRunner(tiny_dir, cache_slots=0, reserved_bytes=0,
                    host_memory_bytes=host + weights - 1)
    text = str(e.value)
    assert format_bytes(host) in text and format_bytes(weights) in text
    assert format_bytes(host + weights - 1) in text and "--expert-dtype" in text
    assert "loaded non-expert weights" not in caplog.text  # refused before loading
    ModelRunner(tiny_dir, cache_slots=0, reserved_bytes=0,
                host_memory_bytes=host + weights).close()  # exactly enough: served


def test_a_cpu_engine_mirrors_small_expert_sets_and_reads_large_ones_in_place(tiny_dir,
                                                                           monkeypatch):
    """No --device-memory or --cache-slots on the CPU: every pair cached when their slots fit
    the stand-in budget (as before), else no slots — the budget is what the engine needs."""
    from services.engine import __main__ as engine_main
    from services.engine.config import EngineConfig

    config = EngineConfig(model=str(tiny_dir))
    assert engine_main.device_budget(config, "cpu") == (engine_main.DEFAULT_CPU_DEVICE_MEMORY,
                                                        None)
    assert engine_main.device_budget(EngineConfig(model=str(tiny_dir), cache_slots=3),
                                     "cpu") == (None, 3)
    monkeypatch.setattr(engine_main, "DEFAULT_CPU_DEVICE_MEMORY", TOTAL_PAIRS * 3 * 64 * 32 * 4 - 1)
    budget, slots = engine_main.device_budget(config, "cpu")
    assert (budget, slots) == (None, 0)
    runner = ModelRunner(tiny_dir, device_memory_bytes=budget, cache_slots=slots)
    assert runner.slots == 0
    seq, _, _ = greedy(runner, PROMPT)
    assert seq.stats.decode.hits == 0 and seq.stats.decode.lookups > 0
