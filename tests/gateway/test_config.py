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
    assert (c.max_inflight, c.max_queue, c.api_keys) == (4, 16, frozenset())


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
])
def test_bad_values_name_the_variable(environ, named):
    with pytest.raises(ConfigError, match=named):
        config([], environ)


def test_main_rejects_bad_settings(capsys):
    assert main(["--max-inflight", "zero"]) == 2
    assert "--max-inflight" in capsys.readouterr().err
