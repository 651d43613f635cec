import argparse

import pytest

from services.common.settings import (
    ConfigError,
    Setting,
    add_settings,
    parse_bool,
    parse_bytes,
    positive_int,
    resolve,
)
from services.common.sizing import size_cache

SETTINGS = (
    Setting("max_inflight", "STRATA_MAX_INFLIGHT", positive_int, 4, "requests at the engine"),
    Setting("device_memory", "STRATA_DEVICE_MEMORY", parse_bytes, None, "budget"),
    Setting("json", "STRATA_JSON", parse_bool, False, "json output"),
)


def parse(argv, environ):
    parser = argparse.ArgumentParser()
    add_settings(parser, SETTINGS)
    return resolve(SETTINGS, parser.parse_args(argv), environ)


def test_flag_beats_env_beats_default():
    assert parse([], {})["max_inflight"] == 4
    assert parse([], {"STRATA_MAX_INFLIGHT": "7"})["max_inflight"] == 7
    assert parse(["--max-inflight", "9"], {"STRATA_MAX_INFLIGHT": "7"})["max_inflight"] == 9
    assert parse(["--json"], {})["json"] is True
    assert parse([], {"STRATA_JSON": "yes"})["json"] is True


def test_bad_value_names_its_source():
    with pytest.raises(ConfigError, match="STRATA_MAX_INFLIGHT='zero'"):
        parse([], {"STRATA_MAX_INFLIGHT": "zero"})
    with pytest.raises(ConfigError, match="--max-inflight='0'"):
        parse(["--max-inflight", "0"], {})
    with pytest.raises(ConfigError, match="STRATA_DEVICE_MEMORY"):
        parse([], {"STRATA_DEVICE_MEMORY": "lots"})


def test_parse_bytes_units():
    assert parse_bytes("700MiB") == 700 * 2**20
    assert parse_bytes("8GiB") == 8 * 2**30
    assert parse_bytes("1.5g") == 1_500_000_000
    assert parse_bytes("123") == 123


def test_size_cache_is_the_design_arithmetic():
    # The reference deployment: 8.31 GiB free, 700 MiB reserved, 184 MiB draft head, 1.318 MiB slots.
    size = size_cache(int(8.31 * 2**30), 700 * 2**20, int(1.318 * 2**20), 24576, 184 * 2**20)
    assert size.slots == (int(8.31 * 2**30) - 884 * 2**20) // int(1.318 * 2**20)
    assert 5700 < size.slots < 5800
    assert "700 MiB reserved (+184 MiB for the draft head) -> " in size.log_line()
    assert size_cache(100, 200, 10, 50).slots == 0
    assert size_cache(10**9, 0, 10, 50).slots == 50


def test_help_texts_may_contain_percent_signs():
    parser = argparse.ArgumentParser()
    add_settings(parser, (Setting("drift", "STRATA_DRIFT", float, 0.02, "e.g. 2% or 0.02"),))
    assert "e.g. 2% or 0.02" in parser.format_help()
