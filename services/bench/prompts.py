"""Prompts of a chosen token length, and the fixed quality set with its recorded answers.

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
QUALITY_PROMPTS = (
    "The capital of France is",
    "1, 2, 3, 4, 5,",
    "def fibonacci(n):",
    "Once upon a time",
    "The quick brown fox",
    "Q: What is 7 times 8?\nA:",
    "Translate to French: good morning ->",
    "<html><body>",
    "SELECT name FROM users WHERE",
    "Roses are red, violets are",
    "import numpy as np\n",
    "Mixture-of-Experts models route each token to",
)


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
    model: str
    max_tokens: int
    cases: tuple[tuple[str, str], ...]  # (prompt, expected greedy continuation)

    @classmethod
    def load(cls, path: Path) -> QualitySet:
        data = json.loads(path.read_text())
        return cls(data["model"], data["max_tokens"],
                   tuple((c["prompt"], c["expected"]) for c in data["cases"]))

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"model": self.model, "max_tokens": self.max_tokens,
                "note": "greedy continuations recorded from the model by "
                        "`strata bench run --record-quality`; checked by exact match",
                "cases": [{"prompt": p, "expected": e} for p, e in self.cases]}
        path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def quality_path(model: str) -> Path:
    return QUALITY_DIR / f"{model}.json"
