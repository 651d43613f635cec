"""The settings each Strata service declares, read from its own config module's source.

`services/<service>/config.py` lists `SETTINGS = (Setting(name, "STRATA_...", parse, default,
help), ...)`; the AST gives the variable names without importing the services (and torch).
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SERVICES = ("engine", "gateway", "cachemgr")
# Read by every service outside SETTINGS: services/common (logging, telemetry, STRATA_HOME) and
# the OpenTelemetry SDK's own variables.
COMMON = frozenset({"STRATA_HOME", "STRATA_LOG_LEVEL", "OTEL_EXPORTER_OTLP_ENDPOINT",
                    "OTEL_RESOURCE_ATTRIBUTES", "OTEL_SERVICE_NAME"})


@cache
def declared(service: str) -> frozenset[str]:
    """Environment variables of `strata <service>`'s declared settings."""
    tree = ast.parse((REPO / "services" / service / "config.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Setting"
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
            names.add(node.args[1].value)
    assert names, f"no Setting(...) found in services/{service}/config.py"
    return frozenset(names)


def accepted(service: str) -> frozenset[str]:
    return declared(service) | COMMON


def read_in_services(name: str) -> bool:
    """The variable's name appears as a string literal somewhere in services/."""
    return any(f'"{name}"' in text or f"'{name}'" in text for text in _sources())


@cache
def _sources() -> tuple[str, ...]:
    return tuple(p.read_text() for p in (REPO / "services").rglob("*.py"))
