import numpy as np
import pytest
import redis

from services.cachemgr.planner import ModelShape
from services.cachemgr.store import DECODE, MemoryStore, RedisStore, redact_url

SHAPE = ModelShape("fp-store", 3, 5, 1)


def random_counts(seed):
    return np.random.default_rng(seed).integers(0, 4, (3, 5))  # [L, E], many zeros


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_counts_add_up(kind, redis_server):
    store = MemoryStore() if kind == "memory" else RedisStore(redis_server.url)
    a, b = random_counts(1), random_counts(2)
    await store.add(SHAPE.fingerprint, a)
    np.testing.assert_array_equal(await store.counts(SHAPE), a)
    await store.add(SHAPE.fingerprint, b)
    np.testing.assert_array_equal(await store.counts(SHAPE, fresh=False), a + b)
    np.testing.assert_array_equal(await store.counts(SHAPE), a + b)
    other = ModelShape("fp-other", 3, 5, 1)
    assert not (await store.counts(other)).any()
    await store.close()


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_decode_counts_are_kept_apart(kind, redis_server):
    store = MemoryStore() if kind == "memory" else RedisStore(redis_server.url)
    every, decode = random_counts(3) + 1, random_counts(4)
    await store.add(SHAPE.fingerprint, every)
    await store.add(SHAPE.fingerprint, decode, phase=DECODE)
    np.testing.assert_array_equal(await store.counts(SHAPE), every)
    np.testing.assert_array_equal(await store.counts(SHAPE, phase=DECODE), decode)
    if kind == "redis":
        client = redis.Redis.from_url(redis_server.url)
        assert client.exists("strata:routing-decode:fp-store")
        # Not under the all-tokens prefix, which readers scan for one hash per model.
        assert all(b"decode" not in key for key in client.scan_iter("strata:routing:*"))
        client.close()
    await store.close()


async def test_redis_layout_and_foreign_fields(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    client.hset("strata:routing:fp-store", mapping={"2:4": 7, "9:9": 1, "junk": 3})
    store = RedisStore(redis_server.url)
    counts = await store.counts(SHAPE)
    assert counts[2, 4] == 7 and counts.sum() == 7  # out-of-shape and junk fields ignored
    await store.add(SHAPE.fingerprint, np.eye(3, 5, dtype=np.int64))
    assert client.hgetall("strata:routing:fp-store") == {
        b"0:0": b"1", b"1:1": b"1", b"2:2": b"1", b"2:4": b"7", b"9:9": b"1", b"junk": b"3"}
    client.close()
    await store.close()


def test_redact_url():
    assert redact_url("redis://user:secret@host:6379/0") == "redis://user:***@host:6379/0"
    assert redact_url("redis://host:6379/0") == "redis://host:6379/0"
