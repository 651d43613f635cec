"""Sampling: greedy is argmax, seeded draws reproduce, top-k / top-p restrict the support."""

from __future__ import annotations

import pytest
import torch

from services.engine.sampling import Sampler, SamplingConfig


def logits(seed: int = 0, vocab: int = 64) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    sampler = Sampler(SamplingConfig())
    for seed in range(5):
        assert sampler.sample(logits(seed)) == int(logits(seed).argmax())


def test_seeded_sampling_is_reproducible():
    cfg = SamplingConfig(temperature=1.0, seed=1234)
    a = [Sampler(cfg).sample(logits(i)) for i in range(20)]
    s1, s2 = Sampler(cfg), Sampler(cfg)
    assert [s1.sample(logits(i)) for i in range(20)] == [s2.sample(logits(i)) for i in range(20)]
    draws = Sampler(SamplingConfig(temperature=1.0, seed=1234))
    assert len({draws.sample(logits(0)) for _ in range(50)}) > 3  # really random
    assert a == [Sampler(cfg).sample(logits(i)) for i in range(20)]


def test_top_k_restricts_support():
    x = logits(1)
    allowed = set(torch.topk(x, 3).indices.tolist())
    sampler = Sampler(SamplingConfig(temperature=2.0, top_k=3, seed=0))
    assert {sampler.sample(x) for _ in range(200)} == allowed
    assert int((sampler.probs(x) > 0).sum()) == 3


def test_top_p_restricts_support():
    x = torch.tensor([4.0, 3.0, 0.0, -1.0, -2.0])  # p ~ [0.71, 0.26, 0.013, ...]
    sampler = Sampler(SamplingConfig(temperature=1.0, top_p=0.9, seed=0))
    probs = sampler.probs(x)
    assert (probs[:2] > 0).all() and (probs[2:] == 0).all()
    assert probs.sum().item() == pytest.approx(1.0)
    assert {sampler.sample(x) for _ in range(200)} == {0, 1}
    tiny = Sampler(SamplingConfig(temperature=1.0, top_p=0.01, seed=0))
    assert {tiny.sample(x) for _ in range(20)} == {0}  # the top token always survives


def test_top_k_then_top_p():
    x = torch.tensor([2.0, 1.9, 1.8, 1.7, -5.0])
    probs = Sampler(SamplingConfig(temperature=1.0, top_k=3, top_p=0.6)).probs(x)
    assert (probs[:2] > 0).all() and (probs[2:] == 0).all()


@pytest.mark.parametrize(
    "kwargs", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1)]
)
def test_invalid_configs_rejected(kwargs):
    with pytest.raises(ValueError):
        SamplingConfig(**kwargs)


def test_penalties_follow_their_definitions():
    """On constructed logits: OpenAI's frequency and presence penalties subtract per generated
    occurrence and once per generated token; vLLM's repetition penalty divides a positive
    logit and multiplies a negative one for tokens of the prompt or the output."""
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, 1.0])
    s = Sampler(SamplingConfig(frequency_penalty=0.5, presence_penalty=0.25))
    for t in (3, 3, 0):
        s.observe(t)
    want = logits.clone()
    want[3] -= 0.5 * 2 + 0.25
    want[0] -= 0.5 * 1 + 0.25
    assert torch.equal(s.process(logits), want)
    r = Sampler(SamplingConfig(repetition_penalty=2.0), prompt_ids=[1, 4])
    r.observe(3)
    assert torch.equal(r.process(logits), torch.tensor([2.0, -2.0, 0.5, 1.5, 0.5]))
    assert Sampler(SamplingConfig()).process(logits) is logits  # nothing to do: untouched


def test_logit_bias_min_tokens_and_min_p():
    logits = torch.tensor([0.0, 1.0, 5.0, 1.0])
    biased = Sampler(SamplingConfig(logit_bias=((0, 10.0), (2, -100.0))))
    assert biased.sample(logits) == 0  # greedy over the biased logits
    ending = Sampler(SamplingConfig(min_tokens=2), end_ids=[2])
    assert ending.sample(logits) != 2  # EOS masked before min_tokens
    ending.observe(1)
    ending.observe(1)
    assert ending.sample(logits) == 2  # and allowed after
    keep = Sampler(SamplingConfig(temperature=1.0, min_p=0.1, seed=0)).probs(logits)
    assert keep[2] > 0 and torch.equal(keep[[0, 1, 3]], torch.zeros(3))  # e^-4 < 0.1 of e^0
    assert abs(float(keep.sum()) - 1.0) < 1e-6
    assert SamplingConfig(min_tokens=1).history_dependent
    assert not SamplingConfig(logit_bias=((1, 1.0),)).history_dependent
