"""The draft-source contract: what proposes the k tokens one verification step checks.

    engine step:  DraftSource.propose(one DraftRequest per decoding sequence)
                  -> scheduler reserves KV for k+1 positions per sequence
                  -> runner.step: ONE forward over [last token, d1 .. dk] (experts fetched once
                     per step for all k+1 positions) -> logits [k+1, V]
                  -> verify.accept_tokens: the longest accepted prefix + one more token

A source that runs its own forward (a draft model, an MTP head) reports its expert-cache lookups
apart from the verification's (`draft_lookups`); prompt lookup (ngram) runs none.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

SPEC_METHODS = ("ngram", "mtp", "draft")


@dataclass(frozen=True)
class DraftRequest:
    """One decoding sequence: `token_ids` are the prompt then every token generated so far (the
    last one not yet run through the model); at most `max_tokens` drafts are wanted."""

    seq_id: int
    token_ids: Sequence[int]
    prompt_len: int
    max_tokens: int


class DraftSource(ABC):
    """Proposes draft tokens. Proposals need not be right (verification keeps the output
    exact) but must be deterministic given the tokens: the acceptance rule treats a proposal as
    a point mass (`draft_probs` is None)."""

    method: str = ""
    memory_bytes: int = 0  # device memory the source keeps (reserved before the expert cache)
    draft_lookups: int = 0  # expert-cache lookups by the source's own forward passes

    @abstractmethod
    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Per request, 0..max_tokens proposed tokens (in order)."""

    def release(self, seq_id: int) -> None:  # noqa: B027 - optional hook
        """The sequence finished or was preempted: drop any state kept for it."""

    def describe(self) -> str:
        return self.method
