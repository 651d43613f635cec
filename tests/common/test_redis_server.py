import pytest
import redis

from services.common.redis_server import EmbeddedRedis, RedisStartError


def test_embedded_redis_serves_and_stops():
    with EmbeddedRedis() as server:
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        assert client.config_get("save") == {"save": ""}  # nothing written to disk
        client.hincrby("strata:test", "0:1", 5)
        assert client.hget("strata:test", "0:1") == b"5"
        client.close()
    assert not server.running


def test_persistence_dir_keeps_data_across_restarts(tmp_path):
    with EmbeddedRedis(data_dir=tmp_path) as server:
        client = redis.Redis.from_url(server.url)
        client.set("kept", "yes")
        client.close()
    assert (tmp_path / "dump.rdb").exists()
    with EmbeddedRedis(data_dir=tmp_path) as server:
        client = redis.Redis.from_url(server.url)
        assert client.get("kept") == b"yes"
        client.close()


def test_taken_port_is_a_clear_error():
    with EmbeddedRedis() as server:
        with pytest.raises(RedisStartError, match=f"port {server.port} is taken|already in use"):
            EmbeddedRedis(port=server.port).start()
        assert redis.Redis.from_url(server.url).ping()
