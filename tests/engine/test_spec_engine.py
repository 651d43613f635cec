"""Speculative decoding on a real runner: greedy output identical with and without it (alone,
batched, every K, several cache sizes), limits / stop strings / EOS / logprobs when a step
emits several tokens, the sampled output distribution against the exact one (chi-square), and
its telemetry (log line, GetStatus, metrics, per-request figures)."""

from __future__ import annotations

import logging
import math
import re
import urllib.request
from collections import Counter
from collections.abc import Sequence

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.pb.strata.v1 import engine_pb2, engine_pb2_grpc
from services.common.settings import format_bytes
from services.common.telemetry import setup_metrics
from services.engine.core import Engine
from services.engine.driver import SequenceDriver
from services.engine.requests import EngineRequest, GenerateParams
from services.engine.runner import ModelRunner
from services.engine.sampling import Sampler, SamplingConfig
from services.engine.server import StatusSource, set_serving, start_server
from services.engine.spec.base import DraftRequest, DraftSource
from services.engine.spec.ngram import NgramDraft
from tests.engine.test_batching import run_all

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
    "The expert cache holds",
    "abcabcabcabcabc",
    "Misses, not hits, drive speed: " * 3,
    "a",
]


def make_runner(path, slots: int | None = None, **kwargs) -> ModelRunner:
    """A runner of `slots` slots (default: every pair)."""
    return ModelRunner(path, cache_slots=10**9 if slots is None else slots, reserved_bytes=0,
                       **kwargs)


def request(
    prompt: str, max_tokens: int = 32, stop: tuple[str, ...] = (), logprobs=False, **sampling
) -> EngineRequest:
    return EngineRequest(
        "r",
        GenerateParams(
            max_tokens=max_tokens,
            stop=stop,
            logprobs=logprobs,
            top_logprobs=2 if logprobs else 0,
            sampling=SamplingConfig(**sampling),
        ),
        prompt=prompt,
    )


@pytest.fixture
def engine_factory(tiny_dir):
    engines = []

    def make(
        spec_tokens=0,
        draft_source=None,
        max_running=8,
        max_step_tokens=64,
        slots=None,
        runner=None,
        **runner_kwargs,
    ) -> Engine:
        source = draft_source or (NgramDraft() if spec_tokens else None)
        engine = Engine(
            runner or make_runner(tiny_dir, slots, **runner_kwargs),
            max_running=max_running,
            max_step_tokens=max_step_tokens,
            draft_source=source,
            spec_tokens=spec_tokens,
        )
        engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.stop()


@pytest.fixture(scope="module")
def plain_greedy(tiny_dir) -> list[list[int]]:
    engine = Engine(make_runner(tiny_dir), max_running=1)
    engine.start()
    try:
        return [c.tokens for c in run_all(engine, [request(p) for p in PROMPTS])]
    finally:
        engine.stop()


def assert_all_blocks_free(engine: Engine) -> None:
    blocks = engine.scheduler.blocks
    assert blocks.num_free_blocks == blocks.num_blocks


@pytest.mark.parametrize("spec_tokens,slots", [(1, 8), (2, 4), (4, 8), (4, None), (7, 12)])
def test_greedy_output_is_identical_with_speculation(
    engine_factory, plain_greedy, spec_tokens, slots
):
    """Alone (one sequence per step) and batched (prefill chunks, drafts cut by the step's
    token budget), at several cache sizes: the tokens plain decoding gives, with drafts both
    accepted and rejected on the way."""
    alone = engine_factory(spec_tokens, max_running=1, slots=slots)
    clients = run_all(alone, [request(p) for p in PROMPTS])
    assert [c.tokens for c in clients] == plain_greedy
    batched = engine_factory(spec_tokens, max_running=8, max_step_tokens=12, slots=slots)
    clients = run_all(batched, [request(p) for p in PROMPTS])
    assert [c.tokens for c in clients] == plain_greedy
    stats = [c.finished.stats for c in clients]
    proposed = sum(s.drafts_proposed for s in stats)
    accepted = sum(s.drafts_accepted for s in stats)
    assert 0 < accepted < proposed
    assert all(s.hits + s.spilled == s.lookups > 0 for s in stats)
    for engine in (alone, batched):
        assert_all_blocks_free(engine)
        assert engine.totals.drafts_accepted > 0


def test_limits_stop_strings_eos_and_logprobs_hold_when_a_step_emits_several_tokens(
    engine_factory, tiny_dir
):
    plain = engine_factory(0, max_running=1)
    spec = engine_factory(4, max_running=1)
    prompt = PROMPTS[0]
    [ref] = run_all(plain, [request(prompt, max_tokens=40, logprobs=True)])
    [got] = run_all(spec, [request(prompt, max_tokens=40, logprobs=True)])
    assert got.tokens == ref.tokens and got.text == ref.text
    assert got.finished.stats.drafts_accepted >= 4, "too few multi-token steps to test"
    assert [lp.token_id for lp in got.logprobs] == got.tokens
    for a, b in zip(got.logprobs, ref.logprobs, strict=True):
        assert math.isclose(a.logprob, b.logprob, rel_tol=1e-4, abs_tol=1e-4)
        assert [t.token_id for t in a.top] == [t.token_id for t in b.top]
    for max_tokens in (1, 2, 3, 5, 8, 13):
        [c] = run_all(spec, [request(prompt, max_tokens=max_tokens)])
        assert c.tokens == ref.tokens[:max_tokens] and c.finished.reason == "length"
        assert c.finished.stats.completion_tokens == max_tokens
    for stop in {ref.text[i : i + 2] for i in (5, 11, 17, 23)}:
        expected = run_all(plain, [request(prompt, max_tokens=40, stop=(stop,))])[0]
        [c] = run_all(spec, [request(prompt, max_tokens=40, stop=(stop,))])
        assert (c.text, c.finished.reason) == (expected.text, expected.finished.reason)
        assert c.finished.reason == "stop" and stop not in c.text
    # EOS: make a token the output reaches mid-way an end-of-sequence token for both engines.
    eos = ref.tokens[9]
    for engine in (plain, spec):
        engine.runner.tokenizer.eos_token_ids = {eos}
    expected = run_all(plain, [request(prompt, max_tokens=40)])[0]
    [c] = run_all(spec, [request(prompt, max_tokens=40)])
    assert c.tokens == expected.tokens == ref.tokens[: ref.tokens.index(eos)]
    assert c.finished.reason == expected.finished.reason == "stop"
    assert_all_blocks_free(spec)


class TableDraft(DraftSource):
    """Drafts from a table keyed by the tokens generated so far (deterministic)."""

    method = "table"

    def __init__(self, table: dict[tuple[int, ...], list[int]]):
        self.table = table

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [
            self.table.get(tuple(r.token_ids[r.prompt_len :]), [])[: r.max_tokens] for r in requests
        ]


def test_sampled_output_keeps_the_models_distribution(engine_factory, tiny_dir):
    """The joint distribution of the first three sampled tokens (temperature 1, top-k 3) over
    many seeds, against the exact one computed branch by branch with the plain runner; the
    second and third come out of verification steps (drafts kept and rejected)."""
    cfg = SamplingConfig(temperature=1.0, top_k=3)
    sampler = Sampler(cfg)
    runner = make_runner(tiny_dir)
    prompt = runner.tokenizer.encode("def add(a, b):\n    return")

    drive = SequenceDriver(runner)

    def probs(prefix: tuple[int, ...]) -> dict[int, float]:
        seq = drive.start(prompt)
        logits = drive.prefill(seq)
        for token in prefix:
            logits = drive.decode(seq, token)
        drive.release(seq)
        p = sampler.probs(logits)
        return {int(t): float(p[t]) for t in torch_nonzero(p)}

    exact: dict[tuple[int, ...], float] = {}
    table: dict[tuple[int, ...], list[int]] = {}
    for t1, p1 in probs(()).items():
        second = probs((t1,))
        likely = max(second, key=second.get)
        third_after_likely = probs((t1, likely))
        unlikely = min(third_after_likely, key=third_after_likely.get)
        table[(t1,)] = [likely, unlikely]  # one draft often kept, one often rejected
        for t2, p2 in second.items():
            third = probs((t1, t2))
            table[(t1, t2)] = [max(third, key=third.get)]
            for t3, p3 in third.items():
                exact[(t1, t2, t3)] = p1 * p2 * p3
    eos = runner.tokenizer.eos_token_ids
    assert not any(eos & set(k) for k in exact), "pick a prompt whose tree has no EOS"

    source = TableDraft(table)
    engine = engine_factory(2, draft_source=source, runner=runner, max_running=8)
    num = 900
    clients = run_all(
        engine,
        [
            request(
                runner.tokenizer.decode(prompt), max_tokens=4, temperature=1.0, top_k=3, seed=seed
            )
            for seed in range(num)
        ],
    )
    seen = Counter(tuple(c.tokens[:3]) for c in clients)
    assert set(seen) <= set(exact)
    cells = [k for k in exact if exact[k] * num >= 5]
    observed = [seen[k] for k in cells] + [num - sum(seen[k] for k in cells)]
    expected = [exact[k] * num for k in cells] + [num - sum(exact[k] * num for k in cells)]
    if expected[-1] < 5:  # fold a small remainder into the statistic's last cell
        observed, expected = (
            observed[:-2] + [sum(observed[-2:])],
            expected[:-2] + [sum(expected[-2:])],
        )
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    df = len(cells) - 1 if len(expected) == len(cells) else len(cells)
    z = 3.72  # p = 1e-4, Wilson-Hilferty
    bound = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert stat < bound, (stat, bound, observed, expected)
    totals = engine.totals
    assert 0 < totals.drafts_accepted < totals.drafts_proposed
    assert_all_blocks_free(engine)


class BrokenDraft(DraftSource):
    method = "broken"

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        raise RuntimeError("injected draft failure")


def test_a_failing_draft_source_only_costs_the_drafts(engine_factory, plain_greedy):
    engine = engine_factory(3, draft_source=BrokenDraft())
    clients = run_all(engine, [request(p) for p in PROMPTS])
    assert [c.tokens for c in clients] == plain_greedy
    assert all(c.finished.stats.drafts_proposed == 0 for c in clients)


def torch_nonzero(p) -> list[int]:
    return p.nonzero().flatten().tolist()


async def test_telemetry_log_line_status_metrics_and_request_figures(tiny_dir, caplog):
    caplog.set_level(logging.INFO)
    runner = make_runner(tiny_dir)
    engine = Engine(runner, draft_source=NgramDraft(), spec_tokens=3)
    status = StatusSource(engine, "engine-s", runner.model_name, "cpu")
    meter_provider = setup_metrics("strata-engine", 0, "127.0.0.1")
    server, port, health = await start_server(
        engine, status, "127.0.0.1", 0, meter_provider=meter_provider
    )
    engine.start()
    await set_serving(health, True)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            events = [
                e
                async for e in stub.Generate(
                    engine_pb2.GenerateRequest(
                        prompt=PROMPTS[0], sampling=engine_pb2.SamplingParams(max_tokens=24)
                    )
                )
            ]
            s = events[-1].finished.stats
            assert 0 < s.drafts_accepted <= s.drafts_proposed and s.verify_steps > 0
            assert s.draft_acceptance_rate == pytest.approx(s.drafts_accepted / s.drafts_proposed)
            per_token = s.decode.lookups // (
                s.completion_tokens - 1 + s.drafts_proposed - s.drafts_accepted
            )
            assert s.rejected_lookups == (s.drafts_proposed - s.drafts_accepted) * per_token
            assert s.draft_lookups == 0  # prompt lookup runs no forward of its own
            st = await stub.GetStatus(engine_pb2.GetStatusRequest())
            assert (st.spec.method, st.spec.spec_tokens) == ("ngram", 3)
            assert (st.spec.drafts_proposed, st.spec.drafts_accepted) == (
                s.drafts_proposed,
                s.drafts_accepted,
            )
            assert st.spec.acceptance_rate == pytest.approx(s.draft_acceptance_rate)
        lines = [
            r.getMessage()
            for r in caplog.records
            if r.name == "strata.serve" and "strata serve: prompt" in r.getMessage()
        ]
        assert len(lines) == 1
        assert re.search(rf", drafts accepted {s.drafts_accepted}/{s.drafts_proposed}$", lines[0])
        text = urllib.request.urlopen(
            f"http://127.0.0.1:{meter_provider.prometheus_port}/metrics", timeout=5
        ).read()
        samples = {
            (x.name, x.labels.get("strata_spec_outcome")): x.value
            for f in text_string_to_metric_families(text.decode())
            for x in f.samples
            if x.name.startswith("strata_spec")
        }
        assert samples[("strata_spec_draft_tokens_total", "accepted")] == s.drafts_accepted
        assert samples[("strata_spec_draft_tokens_total", "proposed")] == s.drafts_proposed
        assert samples[("strata_spec_acceptance_rate", None)] == pytest.approx(
            s.draft_acceptance_rate
        )
    finally:
        await server.stop(grace=None)
        engine.stop()
        meter_provider.shutdown()


@pytest.fixture(scope="module")
def small_draft_dir(tmp_path_factory):
    """A one-layer draft checkpoint with the tiny target's tokenizer and vocabulary."""
    from services.engine.model.demo import write_demo_checkpoint

    return write_demo_checkpoint(
        tmp_path_factory.mktemp("draft") / "tiny-draft",
        seed=7,
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        vocab_size=320,
    )


@pytest.mark.parametrize("draft", ["self", "small"])
def test_draft_model_greedy_is_identical_and_its_lookups_are_its_own(
    engine_factory, plain_greedy, tiny_dir, small_draft_dir, draft
):
    """A separate draft model (the target itself: near-perfect drafts; a one-layer random one:
    poor drafts) keeps greedy output identical, alone and batched, and runs in its own runner:
    its expert lookups are reported as draft lookups, apart from the target's."""
    from services.engine.spec import make_draft_source

    draft_dir = tiny_dir if draft == "self" else small_draft_dir
    for max_running in (1, 8):
        runner = make_runner(tiny_dir, 8)
        source = make_draft_source("draft", draft_model=draft_dir, tokenizer=runner.tokenizer)
        engine = engine_factory(3, draft_source=source, runner=runner, max_running=max_running)
        clients = run_all(engine, [request(p) for p in PROMPTS])
        assert [c.tokens for c in clients] == plain_greedy
        stats = [c.finished.stats for c in clients]
        assert sum(s.draft_lookups for s in stats) == source.runner.cache.lookups > 0
        decode_rows = sum(
            s.completion_tokens - 1 - s.drafts_accepted + s.drafts_proposed for s in stats
        )
        assert runner.cache.decode.lookups == decode_rows * 2 * 3  # K=2 routed x 3 MoE layers
        accepted = sum(s.drafts_accepted for s in stats) / sum(s.drafts_proposed for s in stats)
        assert accepted > 0.9 if draft == "self" else accepted < 1.0  # random: mostly wrong
        assert_all_blocks_free(engine)
        assert source.blocks.num_free_blocks == source.blocks.num_blocks


def test_draft_model_memory_is_reserved_before_the_cache_is_sized(
    tiny_dir, small_draft_dir, caplog
):
    from services.engine.spec import draft_memory_bytes, make_draft_source

    caplog.set_level(logging.INFO)
    draft_bytes = draft_memory_bytes("draft", small_draft_dir)
    assert draft_bytes > 0 and draft_memory_bytes("ngram") == 0
    probe = make_runner(tiny_dir, 0)
    fixed = probe.cache_size.weight_bytes + probe.cache_size.kv_bytes
    runner = ModelRunner(
        tiny_dir,
        device_memory_bytes=fixed + draft_bytes + 10 * probe.slot_bytes,
        reserved_bytes=0,
        draft_head_bytes=draft_bytes,
    )
    assert runner.slots == 10
    assert any(
        f"- {format_bytes(draft_bytes)} draft head - " in r.getMessage()
        and "-> 10 slots" in r.getMessage() for r in caplog.records
    )
    with pytest.raises(ValueError, match="--spec-draft-model"):
        draft_memory_bytes("draft", None)
    with pytest.raises(ValueError, match="multi-token-prediction"):
        draft_memory_bytes("mtp", None)
    source = make_draft_source("draft", draft_model=small_draft_dir, tokenizer=probe.tokenizer)
    assert source.memory_bytes == draft_bytes and "tiny-draft" in source.describe()

    class OtherTokenizer:
        vocab_size = probe.tokenizer.vocab_size

        def encode(self, text: str) -> list[int]:
            return [1] * len(text)

    with pytest.raises(ValueError, match="tokenizer"):
        source.check_tokenizer(OtherTokenizer())
