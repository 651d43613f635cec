"""Sampling: greedy is argmax, seeded draws reproduce, top-k / top-p restrict the support."""

from __future__ import annotations

import pytest
import torch

from services.engine.sampling import Sampler, SamplingConfig, argmax_ids, top_ids


def logits(seed: int = 0, vocab: int = 64) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    sampler = Sampler(SamplingConfig())
    for seed in range(5):
        assert sampler.sample(logits(seed)) == int(logits(seed).argmax())


def test_argmax_ids_picks_as_torch_argmax_does():
    g = torch.Generator().manual_seed(7)
    rows = torch.randn(6, 32000, generator=g)
    rows[1, [5, 900, 31999]] = 50.0  # equal highest: the first
    rows[2] = float("-inf")  # nothing allowed: id 0, as torch says
    rows[3, [17, 4000]] = float("nan")  # a NaN is the highest
    rows[4, 31999] = 1e30  # the last id
    expected = torch.argmax(rows, dim=-1).tolist()
    assert expected[1:5] == [5, 0, 17, 31999]
    assert argmax_ids(rows) == expected
    assert [argmax_ids(row) for row in rows] == [[e] for e in expected]  # [V]: one id
    assert argmax_ids(rows.to(torch.bfloat16)) == torch.argmax(
        rows.to(torch.bfloat16).float(), dim=-1).tolist()
    strided = torch.randn(32000, 3, generator=g).t()  # rows that are not contiguous
    assert argmax_ids(strided) == torch.argmax(strided, dim=-1).tolist()
    assert argmax_ids(rows[:, :1000]) == torch.argmax(rows[:, :1000], dim=-1).tolist()


def test_top_ids_are_the_highest_first_and_equals_by_id():
    x = torch.randn(32000, generator=torch.Generator().manual_seed(3))
    assert top_ids(x, 20) == torch.topk(x, 20).indices.tolist()
    x[[9, 4, 31000]] = 40.0  # three equal highest: by id
    assert top_ids(x, 4) == [4, 9, 31000, int(torch.topk(x, 4).indices[3])]
    assert top_ids(x[:3], 10) == torch.argsort(x[:3], descending=True).tolist()  # k > V


def test_seeded_sampling_is_reproducible():
    cfg = SamplingConfig(temperature=1.0, seed=1234)
    a = [Sampler(cfg).sample(logits(i)) for i in range(20)]
    s1, s2 = Sampler(cfg), Sampler(cfg)
    assert [s1.sample(logits(i)) for i in range(20)] == [s2.sample(logits(i)) for i in range(20)]
    draws = Sampler(SamplingConfig(temperature=1.0, seed=1234))
    assert len({draws.sample(logits(0)) for _ in range(500)}) > 3  # really random
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


def test_top_p_keeps_equals_together():
    """A token is kept when its more probable tokens' mass is < top_p: equally probable
    tokens are all in or all out, whatever order a sort would put them in."""
    x = torch.tensor([1.0, 0.0, 0.0, 0.0, -9.0]).log_softmax(-1)  # p ~ [0.48, 0.17 x 3, ~0]
    probs = Sampler(SamplingConfig(temperature=1.0, top_p=0.5)).probs(x)
    assert (probs[:4] > 0).all() and probs[4] == 0
    assert probs[1] == probs[2] == probs[3]
    probs = Sampler(SamplingConfig(temperature=1.0, top_p=0.4)).probs(x)
    assert probs.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


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
    for t in (3, 1, 0):  # seen again, or in the prompt: once; new: from now on
        r.observe(t)
    assert torch.equal(r.process(logits), torch.tensor([1.0, -2.0, 0.5, 1.5, 0.5]))
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


def reference_probs(x: torch.Tensor, temperature: float, top_k: int, top_p: float,
                    min_p: float) -> torch.Tensor:
    """The definitions, the plain way: the whole vocabulary sorted."""
    scaled = x.float() / temperature
    if 0 < top_k < len(x):
        cut = torch.full_like(scaled, float("-inf"))
        keep = torch.topk(scaled, top_k).indices
        cut[keep] = scaled[keep]
        scaled = cut
    probs = torch.softmax(scaled.double(), dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        sorted_p[torch.cumsum(sorted_p, dim=-1) - sorted_p >= top_p] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    if min_p > 0.0:
        probs = torch.where(probs >= min_p * probs.max(), probs, 0.0)
    return (probs / probs.sum()).float()


@pytest.mark.parametrize("vocab", [64, 5000])
@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 0, 0.9, 0.0), (0.7, 40, 1.0, 0.0), (1.3, 50, 0.95, 0.0),
    (0.7, 0, 1.0, 0.05), (1.0, 20, 0.8, 0.1), (2.0, 0, 0.999, 0.0)])
def test_probs_follow_the_definitions(vocab, temperature, top_k, top_p, min_p):
    """The support and probabilities equal the sort-everything reference (a support that
    needs more than the first 256 tokens sorted included: vocab 5000 at temperature 2)."""
    cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    for seed in range(4):
        x = logits(seed, vocab)
        want = reference_probs(x, temperature, top_k, top_p, min_p)
        got = Sampler(cfg).probs(x)
        assert torch.equal(got > 0, want > 0), (seed, int((got > 0).sum()), int((want > 0).sum()))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    if (vocab, temperature, top_p) == (5000, 2.0, 0.999):
        assert int((want > 0).sum()) > 2048  # the top-p support outgrew two partitions


def test_draws_follow_the_distribution():
    """Sampled frequencies match probs (a chi-square bound, mean + 7 sigma, that a correct
    sampler all but never exceeds), with top-k / top-p cutting and without."""
    n = 20000
    for cfg in (SamplingConfig(temperature=1.5, seed=3),
                SamplingConfig(temperature=1.0, top_k=12, top_p=0.9, seed=4)):
        x = logits(5, 40) / 3  # unit scale: a broad distribution
        sampler = Sampler(cfg)
        p = sampler.probs(x).double()
        counts = torch.bincount(torch.tensor([sampler.sample(x) for _ in range(n)]),
                                minlength=40).double()
        assert not counts[p == 0].any()  # nothing outside the support
        big = n * p >= 5  # the chi-square's bins: these tokens, and the rest of the support
        observed = torch.cat([counts[big], counts[~big].sum().reshape(1)])
        expected = n * torch.cat([p[big], p[~big].sum().reshape(1)])
        assert int(big.sum()) >= 8
        chi2 = float(((observed - expected) ** 2 / expected.clamp(min=1e-9)).sum())
        dof = int(big.sum())
        assert chi2 < dof + 7 * (2 * dof) ** 0.5, (chi2, dof)
    draws = Sampler(SamplingConfig(temperature=1.0, seed=0))
    spread = torch.zeros(5000)  # mass in four blocks of the draw's 1024, the rest none
    spread[[3, 1500, 1501, 4999]] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    picks = torch.bincount(torch.tensor([draws.draw(spread) for _ in range(n)]), minlength=5000)
    assert set(torch.nonzero(picks).flatten().tolist()) == {3, 1500, 1501, 4999}
    observed, expected = picks[[3, 1500, 1501, 4999]].double(), n * spread[[3, 1500, 1501, 4999]]
    assert float(((observed - expected) ** 2 / expected).sum()) < 3 + 7 * 6 ** 0.5
    with pytest.raises(ValueError, match="no token can be drawn"):
        draws.draw(torch.zeros(8))
    for bad in (float("-inf"), float("nan")):
        with pytest.raises(ValueError, match="no token can be drawn"):
            draws.sample(torch.full((8,), bad))
