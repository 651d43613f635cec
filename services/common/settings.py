"""Declared settings: one place per service lists its flags and `STRATA_*` variables.

A `Setting` is both a command-line flag and an environment variable. The value comes from the
flag if given, else the variable, else the default. A bad value raises `ConfigError` naming the
flag or variable it came from, so an operator knows what to fix.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """A setting has a value the service cannot use."""


_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def parse_bytes(text: str | int) -> int:
    """'8GiB', '700MiB', '1.5g', '123' -> bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 8GiB, 700MiB, 2000000)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(num_bytes: float) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(num_bytes) >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{int(num_bytes)} B"


def parse_bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    lowered = text.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off", ""}:
        return False
    raise ValueError(f"not a boolean: {text!r} (use true/false)")


@dataclass(frozen=True)
class Setting:
    name: str  # attribute name on the config dataclass, e.g. "max_inflight"
    env: str  # e.g. "STRATA_MAX_INFLIGHT"
    parse: Callable[[str], Any]
    default: Any
    help: str
    flag: str = ""  # defaults to --max-inflight

    @property
    def option(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")


def add_settings(parser: argparse.ArgumentParser, settings: Iterable[Setting]) -> None:
    """Add one flag per setting; flags left out parse as None so env/default can fill them."""
    for s in settings:
        # argparse %-formats help texts; settings' texts are plain.
        text = f"{s.help} [env {s.env}, default {s.default}]".replace("%", "%%")
        if s.parse is parse_bool:
            parser.add_argument(s.option, dest=s.name, action=argparse.BooleanOptionalAction,
                                default=None, help=text)
        else:
            parser.add_argument(s.option, dest=s.name, default=None, metavar=s.name.upper(),
                                help=text)


def resolve(settings: Iterable[Setting], args: argparse.Namespace | None = None,
            environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Values by setting name: flag, then environment variable, then default."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for s in settings:
        raw = getattr(args, s.name, None) if args is not None else None
        source = s.option
        if raw is None and environ.get(s.env, "") != "":
            raw, source = environ[s.env], s.env
        if raw is None:
            values[s.name] = s.default
            continue
        try:
            values[s.name] = s.parse(raw)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{source}={raw!r}: {exc}") from None
    return values


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("must be >= 1")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("must be >= 0")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError("must be > 0")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise ValueError("must be >= 0")
    return value


def port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError("must be a TCP port, 0..65535 (0 = any free port)")
    return value


def choice(options: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in options:
            raise ValueError(f"must be one of {', '.join(options)}")
        return text
    return parse


def optional_str(text: str) -> str | None:
    return text or None
