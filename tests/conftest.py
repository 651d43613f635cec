"""Shared by every test."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture(autouse=True)
def _root_logging_restored():
    """A test that runs a service's main() in-process gets its `setup_logging()`: a root
    handler writing to that test's captured stderr, closed once the test ends. Later tests'
    log records would go there too ("--- Logging error ---" on stderr, with the record and the
    exception being handled). Each test leaves the root logger as it found it."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
