"""Checkpoints that ship with Strata.

`strata-stdlib-moe` is the default model of every command: a small `qwen3_moe` trained on the
Python standard library by `strata model train-demo` (its model card is the directory's README.md).
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_NAME = "strata-stdlib-moe"


def default_model_dir() -> Path:
    """The shipped default checkpoint (package data: present in editable and wheel installs)."""
    return Path(__file__).resolve().parent / DEFAULT_MODEL_NAME
