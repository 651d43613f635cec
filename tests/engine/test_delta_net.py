"""Gated DeltaNet (services/engine/model/layers/delta_net.py): a prefill span's closed-form
chunks equal the token-by-token recurrence, however the tokens are split into spans and
steps; states are per sequence and dropped on release; a verification span rewinds to its
accepted prefix."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from services.engine.kernels.backend import TorchBackend
from services.engine.model.layers.delta_net import GatedDeltaNet
from services.engine.model.step import Span

D, Hk, Hv, Dk, Dv, Kc = 32, 2, 4, 8, 8, 4


def layer(seed: int = 0) -> GatedDeltaNet:
    g = torch.Generator().manual_seed(seed)
    C = 2 * Hk * Dk + Hv * Dv

    def w(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) * 0.3  # [out, in]

    return GatedDeltaNet(qkvz=w(C + Hv * Dv, D), ba=w(2 * Hv, D),
                         conv=torch.randn(Kc, C, generator=g) * 0.5,
                         decay=-torch.rand(Hv, generator=g) * 2, dt_bias=torch.ones(Hv),
                         norm=torch.ones(Dv) + 0.1 * torch.randn(Dv, generator=g),
                         out=w(D, Hv * Dv), key_heads=Hk, value_heads=Hv, key_dim=Dk,
                         value_dim=Dv, eps=1e-6)


def run(net: GatedDeltaNet, x: torch.Tensor, spans: list[Span]) -> torch.Tensor:
    step = SimpleNamespace(backend=TorchBackend(torch.device("cpu")), all_spans=spans)
    return net(x, step)  # type: ignore[arg-type]


@pytest.mark.parametrize("cut", [1, 63, 64, 100])
def test_chunked_prefill_equals_the_token_recurrence(cut):
    """150 tokens of one sequence as a prefill of `cut` tokens, then the rest as another
    prefill (the state carried between them, chunk boundaries anywhere), equal one token
    per step; a second sequence in the same steps does not disturb the first."""
    x = torch.randn(150, D, generator=torch.Generator().manual_seed(1))
    by_token = layer()
    want = torch.cat([run(by_token, x[t:t + 1], [Span(0, 1, t, (), 7)]) for t in range(150)])
    chunked = layer()
    other = torch.randn(5, D)
    first = run(chunked, torch.cat([x[:cut], other]), [Span(0, cut, 0, (), 7),
                                                       Span(cut, cut + 5, 0, (), 8)])
    rest = run(chunked, x[cut:], [Span(0, 150 - cut, cut, (), 7)]) if cut > 1 else None
    if cut == 1:  # a one-token "prefill" is a decode row: advance the rest as decode rows
        rest = torch.cat([run(chunked, x[t:t + 1], [Span(0, 1, t, (), 7)])
                          for t in range(1, 150)])
    got = torch.cat([first[:cut], rest])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert set(chunked.states) == {7, 8}
    chunked.release(8)
    assert set(chunked.states) == {7}


def test_decode_rows_of_several_sequences_advance_together():
    net, alone = layer(2), layer(2)
    x = torch.randn(3, 10, D, generator=torch.Generator().manual_seed(3))
    for t in range(10):
        spans = [Span(i, i + 1, t, (), i) for i in range(3)]
        together = run(net, x[:, t], spans)
        for i in range(3):
            one = run(alone, x[i, t:t + 1], [Span(0, 1, t, (), i)])
            # fp32 torch products of 3 rows and of 1 take different kernels on some CPUs (an
            # AVX-512 Xeon: 2.8e-6 apart after 10 recurrent steps): agreement to fp32 noise
            torch.testing.assert_close(together[i:i + 1], one, rtol=1e-4, atol=1e-5)


def test_a_position_past_zero_without_its_state_is_refused():
    with pytest.raises(RuntimeError, match="whose state is at none"):
        run(layer(), torch.randn(2, D), [Span(0, 2, 16, (), 3)])


@pytest.mark.parametrize("accepted", [0, 2, 3])
def test_a_verification_span_rewinds_to_its_accepted_prefix(accepted):
    """Last token + 3 drafts verified in one span, `accepted` of them kept: the next tokens'
    outputs are those of decoding the kept rows one by one (the same recurrence; the input
    projection of 4 rows and of 1 may round apart: fp32 noise); a step at the wrong position
    is refused."""
    x = torch.randn(12, D, generator=torch.Generator().manual_seed(5))
    plain, spec = layer(4), layer(4)
    run(plain, x[:6], [Span(0, 6, 0, (), 1)])
    run(spec, x[:6], [Span(0, 6, 0, (), 1)])
    drafted = torch.cat([x[6:7 + accepted], torch.randn(3 - accepted, D)])
    verified = run(spec, drafted, [Span(0, 4, 6, (), 1, drafts=3)])
    kept = [run(plain, x[t:t + 1], [Span(0, 1, t, (), 1)]) for t in range(6, 7 + accepted)]
    close = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(verified[:accepted + 1], torch.cat(kept), **close)
    spec.rewind(1, 7 + accepted)
    assert spec.states[1].pos == 7 + accepted and spec.states[1].replay is None
    for t in range(7 + accepted, 12):
        one = [Span(0, 1, t, (), 1)]
        torch.testing.assert_close(run(spec, x[t:t + 1], one), run(plain, x[t:t + 1], one),
                                   **close)
    with pytest.raises(RuntimeError, match="whose state is at 12"):
        run(spec, x[:1], [Span(0, 1, 7, (), 1)])
