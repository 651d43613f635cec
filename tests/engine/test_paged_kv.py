"""Paged KV pool: reads give back what was written, across blocks; int8 within its error bound."""

import torch

from services.engine.model.paged_kv import PagedKVCache


def fill(cache: PagedKVCache, table, k, v, chunk):
    """Write k, v [N, G, Hd] in chunks of `chunk` positions, as prefill chunks + decodes do."""
    n = k.shape[0]
    for start in range(0, n, chunk):
        pos = torch.arange(start, min(n, start + chunk))
        cache.write(0, cache.slots(table, pos), k[pos], v[pos])


def test_fp32_round_trip_over_scattered_blocks():
    torch.manual_seed(0)
    cache = PagedKVCache(2, num_blocks=10, block_size=4, num_kv_heads=2, head_dim=8,
                         dtype=torch.float32, device=torch.device("cpu"))
    table = [7, 2, 9]  # not contiguous, not in order
    k, v = torch.randn(11, 2, 8), torch.randn(11, 2, 8)
    fill(cache, table, k, v, chunk=3)
    rk, rv = cache.read(0, table, 11)
    assert torch.equal(rk, k.transpose(0, 1)) and torch.equal(rv, v.transpose(0, 1))


def test_int8_error_is_within_half_a_step_of_the_block_scale():
    torch.manual_seed(1)
    cache = PagedKVCache(1, num_blocks=6, block_size=8, num_kv_heads=2, head_dim=16,
                         dtype=torch.float32, device=torch.device("cpu"), kv_dtype="int8")
    table = [3, 0, 5]
    k = torch.randn(20, 2, 16)
    k[13] *= 10  # a late large token forces block 0's earlier entries to be requantized
    v = torch.randn(20, 2, 16)
    fill(cache, table, k, v, chunk=1)
    rk, _ = cache.read(0, table, 20)
    err = (rk - k.transpose(0, 1)).abs()  # [G, N, Hd]
    for b, block in enumerate(table):
        scale = cache.k_scale[0, block]  # [G]
        span = slice(b * 8, min(20, (b + 1) * 8))
        # Rounding once is half a step; requantizing an entry once more adds up to another half.
        assert (err[:, span] <= scale[:, None, None] * 1.0 + 1e-6).all()
    assert PagedKVCache.bytes_per_block(1, 8, 2, 16, torch.float32, "int8") * 4 < \
        PagedKVCache.bytes_per_block(1, 8, 2, 16, torch.float32) * 1.2


def test_int8_block_reused_for_new_tokens_gets_a_fresh_scale():
    cache = PagedKVCache(1, num_blocks=2, block_size=4, num_kv_heads=1, head_dim=8,
                         dtype=torch.float32, device=torch.device("cpu"), kv_dtype="int8")
    big, small = torch.full((4, 1, 8), 100.0), torch.full((4, 1, 8), 0.01)
    fill(cache, [1], big, big, chunk=4)
    fill(cache, [1], small, small, chunk=2)  # the block handed out again, from offset 0
    k, _ = cache.read(0, [1], 4)
    assert torch.allclose(k, small.transpose(0, 1), rtol=0.01)


def test_span_slots_are_each_spans_slots_in_row_order():
    from services.engine.model.step import Span

    cache = PagedKVCache(1, num_blocks=8, block_size=4, num_kv_heads=1, head_dim=2,
                         dtype=torch.float32, device=torch.device("cpu"))
    spans = [Span(0, 5, 3, [6, 2, 7]), Span(5, 6, 9, [1, 0, 5]), Span(6, 9, 0, [3])]
    expected = torch.cat([cache.slots(s.block_table, torch.arange(s.pos_start, s.pos_end))
                          for s in spans])
    assert torch.equal(cache.span_slots(spans), expected)
    assert cache.span_slots(spans).tolist() == [27, 8, 9, 10, 11, 21, 12, 13, 14]


def test_copy_blocks_copies_every_layer_and_int8_scale():
    for kv_dtype in ("auto", "int8"):
        kv = PagedKVCache(3, 6, 4, 2, 8, torch.float32, torch.device("cpu"), kv_dtype)
        k, v = torch.randn(2, 4, 2, 8).unbind(0)
        slots = torch.arange(4) + 4 * 1  # block 1
        for layer in range(3):
            kv.write(layer, slots, k * (layer + 1), v - layer)
        kv.copy_blocks([(1, 4)])
        for layer in range(3):
            assert torch.equal(kv.read(layer, [4], 4)[0], kv.read(layer, [1], 4)[0])
            assert torch.equal(kv.read(layer, [4], 4)[1], kv.read(layer, [1], 4)[1])
        assert not torch.equal(kv.read(0, [4], 4)[0], kv.read(0, [0], 4)[0])
