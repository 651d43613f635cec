"""Continuous batching on a real runner: batched == alone, prefix reuse, int8 KV, lifecycle."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import replace

import pytest

from services.engine.core import Engine
from services.engine.driver import SequenceDriver
from services.engine.requests import Delta, EngineRequest, Finished, GenerateParams, PromptTooLong
from services.engine.runner import ModelRunner
from services.engine.sampling import SamplingConfig

PROMPTS = [
    "The expert cache holds",
    "Routing picks four experts for every token, and",
    "a",
    "Misses, not hits, drive speed: " * 3,
    "def f(x):\n    return",
    "Concurrency must share one cache instead of splitting it, so",
]


def make_runner(path, **kwargs) -> ModelRunner:
    # Room for a third of the pairs: hits and misses both happen.
    return ModelRunner(path, cache_slots=8, reserved_bytes=0,
                       **kwargs)


class Client:
    """Collects one request's events from the engine's loop thread."""

    def __init__(self) -> None:
        self.events: queue.Queue = queue.Queue()
        self.tokens: list[int] = []
        self.text = ""
        self.logprobs: list = []
        self.finished: Finished | None = None

    def __call__(self, event) -> None:
        self.events.put(event)

    def wait(self, timeout_s: float = 120.0) -> Client:
        deadline = time.monotonic() + timeout_s
        while self.finished is None:
            event = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            if isinstance(event, Delta):
                self.tokens.extend(event.token_ids)
                self.text += event.text
                self.logprobs.extend(event.logprobs)
            elif isinstance(event, Finished):
                assert self.finished is None, "two terminal events"
                self.finished = event
        return self


def request(prompt: str, max_tokens: int = 24, ignore_eos: bool = False,
            **sampling) -> EngineRequest:
    return EngineRequest("r", GenerateParams(max_tokens=max_tokens, ignore_eos=ignore_eos,
                                             sampling=SamplingConfig(**sampling)), prompt=prompt)


def run_all(engine: Engine, requests: list[EngineRequest]) -> list[Client]:
    clients = [Client() for _ in requests]
    for req, client in zip(requests, clients, strict=True):
        engine.submit(req, client)
    return [c.wait() for c in clients]


@pytest.fixture
def engine_factory(tiny_dir):
    engines = []

    def make(max_running=8, max_step_tokens=64, prefix_reuse=True, gather_ms=0.0,
             **runner_kwargs) -> Engine:
        engine = Engine(make_runner(tiny_dir, **runner_kwargs), max_running=max_running,
                        max_step_tokens=max_step_tokens, prefix_reuse=prefix_reuse,
                        gather_ms=gather_ms)
        engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.stop()


def test_batched_decode_gives_each_sequence_the_tokens_it_gets_alone(engine_factory):
    # ignore_eos: every sequence decodes all 24 steps in the batch, none leaves it early
    alone = engine_factory(max_running=1)
    expected = [run_all(alone, [request(p, ignore_eos=True)])[0].tokens for p in PROMPTS]
    batched = engine_factory(max_running=8, max_step_tokens=16)  # prefills chunked too
    clients = run_all(batched, [request(p, ignore_eos=True) for p in PROMPTS])
    assert [c.tokens for c in clients] == expected
    assert all(len(c.tokens) == 24 and c.finished.reason == "length" for c in clients)
    for c in clients:
        s = c.finished.stats
        assert s.hits + s.spilled == s.lookups > 0 and s.prefill_lookups > 0


def recording_steps(engine: Engine) -> list[int]:
    """The number of chunks of each step the engine runs from now on."""
    sizes: list[int] = []
    step = engine.runner.step

    def recorded(work, *args, **kwargs):
        sizes.append(len(work))
        return step(work, *args, **kwargs)

    engine.runner.step = recorded
    return sizes


def test_an_idle_engine_starts_the_requests_said_to_follow_in_one_step(engine_factory):
    engine = engine_factory(gather_ms=60_000)
    sizes = recording_steps(engine)
    first, second = Client(), Client()
    engine.submit(replace(request(PROMPTS[0], max_tokens=4), following=1), first)
    time.sleep(0.3)  # the follower comes well after the first: the step still waits for it
    engine.submit(request(PROMPTS[1], max_tokens=4), second)
    first.wait(timeout_s=30)
    second.wait(timeout_s=30)
    assert sizes[0] == 2, f"the first step ran {sizes[0]} request(s), not the burst of 2"


def test_gathering_never_holds_a_lone_request_nor_a_busy_engine_past_its_limit(engine_factory):
    # a lone request (following 0) starts at once: a wait of gather_ms (a minute) would
    # outlast the client's timeout
    engine = engine_factory(gather_ms=60_000)
    sizes = recording_steps(engine)
    lone = Client()
    engine.submit(request(PROMPTS[0], max_tokens=40, ignore_eos=True), lone)
    while not isinstance(lone.events.get(timeout=30), Delta):
        pass
    # while it runs, a request announcing followers that never come joins the next step
    late = Client()
    engine.submit(replace(request(PROMPTS[1], max_tokens=4), following=3), late)
    late.wait(timeout_s=30)
    lone.wait(timeout_s=30)
    assert sizes[0] == 1
    # idle again: followers that never come hold the first step gather_ms at most
    short = engine_factory(gather_ms=200)
    orphan = Client()
    short.submit(replace(request(PROMPTS[2], max_tokens=4), following=5), orphan)
    assert orphan.wait(timeout_s=30).finished.reason == "length"


def test_prefix_reuse_gives_identical_output_and_reports_the_reused_tokens(engine_factory):
    shared = "You are Strata's test assistant. Answer briefly and exactly. " * 2
    prompts = [shared + "First question?", shared + "Second one?"]
    plain = engine_factory(prefix_reuse=False)
    expected = [run_all(plain, [request(p)])[0] for p in prompts]
    reuse = engine_factory(prefix_reuse=True, kv_block_size=8)
    first = run_all(reuse, [request(prompts[0])])[0]
    second = run_all(reuse, [request(prompts[1])])[0]
    assert [first.tokens, second.tokens] == [e.tokens for e in expected]
    assert first.finished.stats.reused_prompt_tokens == 0
    encode = reuse.runner.tokenizer.encode
    a, b = encode(prompts[0]), encode(prompts[1])
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert common % 8, "the prompts part inside a block: its equal start is copied"
    assert second.finished.stats.reused_prompt_tokens == common
    repeated = run_all(reuse, [request(prompts[0])])[0]
    assert repeated.tokens == expected[0].tokens
    assert repeated.finished.stats.reused_prompt_tokens == len(a) - 1, "all but the last token"
    # a prompt whose last block the first run left partly filled (one token generated, none
    # of it computed): the repeat still reuses all but its last token
    short = shared + "Third one?"
    assert len(encode(short)) % 8, "a partly filled last block"
    once = run_all(reuse, [request(short, max_tokens=1)])[0]
    twice = run_all(reuse, [request(short, max_tokens=1)])[0]
    assert twice.tokens == once.tokens
    assert twice.finished.stats.reused_prompt_tokens == len(encode(short)) - 1


def test_int8_kv_agrees_with_fp32(tiny_dir):
    fp32, int8 = (SequenceDriver(make_runner(tiny_dir)),
                  SequenceDriver(make_runner(tiny_dir, kv_dtype="int8")))
    agree = total = 0
    worst = 0.0
    for prompt in PROMPTS:
        ids = fp32.runner.tokenizer.encode(prompt)
        a, b = fp32.start(ids), int8.start(ids)
        la, lb = fp32.prefill(a), int8.prefill(b)
        for _ in range(12):  # follow fp32's greedy path, compare logits at each position
            worst = max(worst, float((la - lb).abs().max() / la.abs().max()))
            agree += int(la.argmax() == lb.argmax())
            total += 1
            token = int(la.argmax())
            la, lb = fp32.decode(a, token), int8.decode(b, token)
        fp32.release(a)
        int8.release(b)
    assert agree / total >= 0.95, f"top-1 agreement {agree}/{total}"
    assert worst < 0.05, f"largest logit error {worst:.3%} of the logit range"


def test_cancellation_frees_the_sequences_blocks_within_a_step(engine_factory):
    engine = engine_factory()
    blocks = engine.scheduler.blocks
    client = Client()
    handle = engine.submit(request(PROMPTS[1], max_tokens=400, temperature=0.8, seed=1), client)
    while not any(isinstance(e, Delta) for e in list(client.events.queue)):
        time.sleep(0.005)
    assert blocks.num_free_blocks < blocks.num_blocks
    handle.cancel()
    client.wait()
    assert client.finished.reason == "abort" and "cancelled" in client.finished.error
    assert blocks.num_free_blocks == blocks.num_blocks
    assert engine.num_running == engine.num_waiting == 0


def test_an_error_in_one_sequence_ends_only_that_request(engine_factory):
    engine = engine_factory()
    poison = engine.runner.tokenizer.encode("\x07")[0]
    real_step = engine.runner.step

    def step(chunks):
        if any(poison in c.token_ids for c in chunks):
            raise RuntimeError("injected fault")
        return real_step(chunks)

    engine.runner.step = step
    clients = run_all(engine, [request("fine one"), request("bad \x07 one"),
                               request("another fine one")])
    assert [c.finished.reason for c in clients][1] == "abort"
    assert "engine error" in clients[1].finished.error
    assert all(c.finished.reason in {"stop", "length"} for c in (clients[0], clients[2]))
    assert engine.scheduler.blocks.num_free_blocks == engine.scheduler.blocks.num_blocks


def test_window_is_enforced_before_admission_and_max_tokens_is_clamped(engine_factory):
    engine = engine_factory()
    window = engine.context_window
    with pytest.raises(PromptTooLong, match=f"context window is {window} tokens"):
        engine.submit(request("x" * window), Client())
    prompt = "y" * (window - 5)
    assert len(engine.runner.tokenizer.encode(prompt)) == window - 5  # one token a byte
    [client] = run_all(engine, [request(prompt, max_tokens=1000, ignore_eos=True,
                                        temperature=0.9, seed=2)])
    assert (client.finished.reason, client.finished.stats.completion_tokens) == ("length", 5)


def test_concurrent_submits_from_many_threads_all_end_once(engine_factory):
    engine = engine_factory(max_running=3)
    clients = [Client() for _ in range(12)]
    threads = [threading.Thread(target=engine.submit, args=(request(PROMPTS[i % 6], 8), c))
               for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in clients:
        c.wait()
    assert engine.totals.requests_finished == 12
    assert engine.scheduler.blocks.num_free_blocks == engine.scheduler.blocks.num_blocks


def test_kv_memory_below_one_window_is_refused(tiny_dir):
    with pytest.raises(ValueError, match="less than the context window"):
        make_runner(tiny_dir, kv_memory_bytes=1024)




def test_the_runner_releases_each_sequence_on_finish_and_on_preemption(tiny_dir, monkeypatch):
    """runner.release(seq_id) reaches the layer parts that keep per-sequence state, once per
    finished request and once more per preemption (a KV pool of one context window, four
    long requests: the newest are preempted and recomputed)."""
    from services.engine.model.paged_kv import PagedKVCache
    from services.engine.scheduler import Scheduler

    class PerSequenceState:
        def __init__(self):
            self.released: list[int] = []

        def release(self, seq_id: int) -> None:
            self.released.append(seq_id)

    probe = make_runner(tiny_dir)
    c = probe.config
    one_window = PagedKVCache.bytes_per_block(c.num_layers, 16, c.num_kv_heads, c.head_dim,
                                              probe.dtype) * (c.context_window // 16)
    runner = make_runner(tiny_dir, kv_memory_bytes=one_window)
    state = PerSequenceState()
    runner.model.per_sequence.append(state)
    preempted: list[int] = []
    preempt = Scheduler._preempt

    def counting(self, seq):
        preempted.append(seq.seq_id)
        preempt(self, seq)

    monkeypatch.setattr(Scheduler, "_preempt", counting)
    engine = Engine(runner, max_running=4, max_step_tokens=64)
    engine.start()
    try:
        clients = run_all(engine, [request("x" * 150 + str(i), max_tokens=90)
                                   for i in range(4)])
    finally:
        engine.stop()
    assert all(cl.finished is not None for cl in clients)
    assert preempted, "the pool of one window did not preempt anyone"
    assert sorted(state.released) == sorted([0, 1, 2, 3] + preempted)
