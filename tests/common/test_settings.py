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
from services.common.sizing import BudgetError, device_limit, size_cache

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
    assert ("expert cache auto: 8.31 GiB budget - 184.00 MiB draft head - 700.00 MiB reserved = "
            in size.log_line())
    assert size_cache(100, 200, 10, 50).slots == 0
    assert size_cache(10**9, 0, 10, 50).slots == 50


def test_help_texts_may_contain_percent_signs():
    parser = argparse.ArgumentParser()
    add_settings(parser, (Setting("drift", "STRATA_DRIFT", float, 0.02, "e.g. 2% or 0.02"),))
    assert "e.g. 2% or 0.02" in parser.format_help()


def test_the_engine_takes_the_smaller_of_its_budget_and_the_free_memory():
    assert device_limit(10 * 2**30, 8 * 2**30) == device_limit(None, 8 * 2**30) == 8 * 2**30
    assert device_limit(6 * 2**30, 8 * 2**30) == device_limit(6 * 2**30, None) == 6 * 2**30
    with pytest.raises(BudgetError, match="--device-memory"):
        device_limit(None, None)
    size = size_cache(20 * 2**30, 700 * 2**20, 2**20, 10**6, 184 * 2**20,
                      weight_bytes=3 * 2**30, kv_bytes=2**30, free_bytes=22 * 2**30,
                      configured_bytes=20 * 2**30)
    assert size.slots == (20 * 2**30 - 3 * 2**30 - 2**30 - 884 * 2**20) // 2**20
    assert size.log_line().startswith(
        "expert cache auto: min(22.00 GiB free, --device-memory 20.00 GiB) = 20.00 GiB - "
        "3.00 GiB weights - 1.00 GiB KV - 184.00 MiB draft head - 700.00 MiB reserved = ")
    fixed = size_cache(1 * 2**30, 0, 2**20, 100, slots=500, how="engine")
    assert fixed.slots == 100 and fixed.log_line().startswith(
        "expert cache: the engine's 100 slots of 1.00 MiB (100.00 MiB, coverage 100.0%")
