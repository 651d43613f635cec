"""Gateway settings: flags, STRATA_* variables, defaults, and errors that name the variable."""

import argparse

import pytest

from services.common.settings import ConfigError, add_settings, resolve
from services.gateway.__main__ import main
from services.gateway.config import SETTINGS, GatewayConfig


def config(argv, environ):
    parser = argparse.ArgumentParser()
    add_settings(parser, SETTINGS)
    return GatewayConfig.from_values(resolve(SETTINGS, parser.parse_args(argv), environ))


def test_defaults():
    c = config([], {})
    assert (c.host, c.port, c.engine_addrs) == ("127.0.0.1", 8000, ("127.0.0.1:50051",))
    assert (c.max_inflight, c.max_queue, c.api_keys) == (8, 16, frozenset())
    assert (c.max_queued_tokens, c.redis_url, c.api_key_hashes, c.log_prompts) == (
        131072, None, None, False)
    assert (c.request_timeout_s, c.drain_timeout_s, c.max_body_bytes) == (600.0, 25.0, 2 << 20)
    assert c.key_hashes == frozenset()  # auth off


def test_new_settings_from_env(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("a" * 64 + "\n")
    c = config(["--log-prompts"], {
        "STRATA_ENGINE_ADDR": "none", "STRATA_REDIS_URL": "redis://r:6379/0",
        "STRATA_MAX_QUEUED_TOKENS": "5000", "STRATA_API_KEYS_FILE": str(keys),
        "STRATA_MAX_BODY_BYTES": "64KiB", "STRATA_DRAIN_TIMEOUT_S": "3",
        "STRATA_REQUEST_TIMEOUT_S": "9.5", "STRATA_HEALTH_CACHE_S": "2",
        "STRATA_LEASE_TTL_S": "6"})
    assert c.engine_addrs == () and c.redis_url == "redis://r:6379/0"
    assert (c.max_queued_tokens, c.max_body_bytes, c.drain_timeout_s) == (5000, 65536, 3.0)
    assert (c.request_timeout_s, c.health_cache_s, c.lease_ttl_s) == (9.5, 2.0, 6.0)
    assert c.log_prompts and c.key_hashes == frozenset({bytes.fromhex("a" * 64)})


def test_no_engines_at_all_is_a_config_error():
    with pytest.raises(ConfigError, match="--redis-url"):
        config([], {"STRATA_ENGINE_ADDR": "none"})


def test_env_and_flags():
    c = config(["--max-queue", "3"], {
        "STRATA_ENGINE_ADDR": "10.0.0.1:50051, 10.0.0.2:50051", "STRATA_MAX_INFLIGHT": "2",
        "STRATA_MAX_QUEUE": "9", "STRATA_API_KEYS": "sk-a,sk-b", "STRATA_GATEWAY_PORT": "9000"})
    assert c.engine_addrs == ("10.0.0.1:50051", "10.0.0.2:50051")
    assert (c.max_inflight, c.max_queue, c.port) == (2, 3, 9000)
    assert c.api_keys == frozenset({"sk-a", "sk-b"}) and c.capacity == 4


@pytest.mark.parametrize(("environ", "named"), [
    ({"STRATA_MAX_INFLIGHT": "0"}, "STRATA_MAX_INFLIGHT"),
    ({"STRATA_MAX_QUEUE": "-1"}, "STRATA_MAX_QUEUE"),
    ({"STRATA_ENGINE_ADDR": "nohost"}, "STRATA_ENGINE_ADDR"),
    ({"STRATA_GATEWAY_PORT": "70000"}, "STRATA_GATEWAY_PORT"),
    ({"STRATA_MAX_QUEUED_TOKENS": "0"}, "STRATA_MAX_QUEUED_TOKENS"),
    ({"STRATA_DRAIN_TIMEOUT_S": "-1"}, "STRATA_DRAIN_TIMEOUT_S"),
    ({"STRATA_LOG_PROMPTS": "maybe"}, "STRATA_LOG_PROMPTS"),
])
def test_bad_values_name_the_variable(environ, named):
    with pytest.raises(ConfigError, match=named):
        config([], environ)


def test_main_rejects_bad_settings(capsys):
    assert main(["--max-inflight", "zero"]) == 2
    assert "--max-inflight" in capsys.readouterr().err
