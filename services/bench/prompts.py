"""Prompts of a chosen token length, and the quality set: prompts with recorded answers.

Prompt text is deterministic pseudo-English (seeded), so every run sends the same requests;
different seeds give different prompts (no accidental prefix reuse between cases). The
chars-per-token ratio is calibrated once against the gateway's own token count.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

_TEXT = ("the system keeps a cache of experts in device memory and reads the rest from host "
         "ram while the scheduler batches requests so that every routed layer finds its "
         "weights quickly planning capacity means knowing coverage hit rate spill and speed "
         "for each budget an operator may buy")
_WORDS = tuple(_TEXT.split(" "))

QUALITY_DIR = Path(__file__).with_name("quality")


def text(num_chars: int, seed: int) -> str:
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < num_chars:
        word = rng.choice(_WORDS)
        parts.append(word)
        size += len(word) + 1
    return " ".join(parts)[:num_chars]


@dataclass
class PromptMaker:
    chars_per_token: float = 1.0

    def make(self, num_tokens: int, seed: int) -> str:
        return text(max(1, round(num_tokens * self.chars_per_token)), seed)

    def calibrate(self, num_chars: int, prompt_tokens: int) -> None:
        if prompt_tokens > 0:
            self.chars_per_token = num_chars / prompt_tokens


@dataclass(frozen=True)
class QualitySet:
    """Prompts with their expected greedy continuations (written by `strata bench quality`)."""

    model: str
    max_tokens: int
    cases: tuple[tuple[str, str], ...]  # (prompt, expected greedy continuation)
    token_ids: tuple[tuple[int, ...], ...] = ()  # the expected continuations' token ids

    @classmethod
    def load(cls, path: Path) -> QualitySet:
        data = json.loads(path.read_text())
        cases = data["cases"]
        ids = tuple(tuple(c["expected_token_ids"]) for c in cases
                    if "expected_token_ids" in c)
        return cls(data["model"], data["max_tokens"],
                   tuple((c["prompt"], c["expected"]) for c in cases),
                   ids if len(ids) == len(cases) else ())

    def write(self, path: Path, note: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        cases = [{"prompt": p, "expected": e} for p, e in self.cases]
        for case, ids in zip(cases, self.token_ids, strict=False):
            case["expected_token_ids"] = list(ids)
        data = {"model": self.model, "max_tokens": self.max_tokens, "note": note,
                "cases": cases}
        path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def agreement(expected: str, got: str) -> float:
    """Share of the expected continuation reproduced before the first difference (1.0 = exact);
    a figure for paths that may drift (int8 KV), where exact match is not the bar."""
    if got == expected:
        return 1.0
    same = 0
    for a, b in zip(expected, got, strict=False):
        if a != b:
            break
        same += 1
    return same / len(expected) if expected else 0.0


def quality_path(model: str) -> Path:
    return QUALITY_DIR / f"{model}.json"
