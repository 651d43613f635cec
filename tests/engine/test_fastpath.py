"""CPU fast path: the expert blob layout and KV reads without copies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.engine.cache.layout import ExpertLayout, swiglu
from services.engine.model.paged_kv import PagedKVCache


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


@pytest.mark.parametrize("tokens", [1, 4])
def test_expert_blob_layout_matches_hf_weights(tokens):
    D, Fs = 32, 16
    layout = ExpertLayout(D, Fs)
    gate, up, down = torch.randn(Fs, D), torch.randn(Fs, D), torch.randn(D, Fs)
    blob = torch.empty(layout.numel)
    layout.pack(gate, up, down, out=blob)
    gate_up_t, down_t = layout.views(blob)
    assert torch.equal(gate_up_t, torch.cat([gate.t(), up.t()], dim=1))
    assert torch.equal(down_t, down.t())
    x = torch.randn(tokens, D)
    want = (F.silu(x @ gate.t()) * (x @ up.t())) @ down.t()
    torch.testing.assert_close(layout.forward(x, blob), want, rtol=1e-4, atol=1e-4)
    assert torch.equal(layout.forward(x, blob), swiglu(x, gate_up_t, down_t))


def test_kv_read_of_consecutive_blocks_is_a_view():
    kv = PagedKVCache(2, 8, 4, 2, 8, torch.float32, torch.device("cpu"))
    kv.k.normal_()
    kv.v.normal_()
    k, v = kv.read(1, [3, 4, 5], 10)  # consecutive: views of the pool
    assert k.shape == v.shape == (2, 10, 8)
    assert k.untyped_storage().data_ptr() == kv.k.untyped_storage().data_ptr()
    k2, v2 = kv.read(1, [3, 4, 6], 10)  # not consecutive: gathered; same first 8 positions
    assert torch.equal(k[:, :8], k2[:, :8]) and torch.equal(v[:, :8], v2[:, :8])
    want = kv.k[1, [3, 4, 5]].flatten(0, 1)[:10].transpose(0, 1)
    assert torch.equal(k, want)
