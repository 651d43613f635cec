"""Prompt lookup: propose what followed the last time the sequence's tail appeared in it.

For n = max_ngram .. min_ngram, the last n tokens (prompt + output so far) are searched for
earlier in the sequence; the tokens that followed the most recent occurrence are the draft
(a longer continuation of an older occurrence wins when the most recent one runs into the end).
Code editing and quoting repeat the prompt, so drafts are long and mostly accepted; free text
gets few. No model runs: the verification forward is the only expert work.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from services.engine.spec.base import DraftRequest, DraftSource

DEFAULT_MAX_NGRAM = 3
DEFAULT_MIN_NGRAM = 1


def lookup(
    tokens: np.ndarray,
    k: int,
    max_ngram: int = DEFAULT_MAX_NGRAM,
    min_ngram: int = DEFAULT_MIN_NGRAM,
) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the tail of `tokens` [N]."""
    n_tokens = len(tokens)
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        tail = tokens[n_tokens - n :]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: n_tokens - 1], n)  # [N-n, n]
        starts = np.flatnonzero((windows == tail).all(axis=1))  # occurrences ending before N-1
        if not len(starts):
            continue
        follow = starts + n  # where each occurrence's continuation begins
        lengths = np.minimum(n_tokens - follow, k)
        best = int(follow[::-1][int(np.argmax(lengths[::-1]))])  # most recent of the longest
        return tokens[best : best + k].tolist()
    return []


class NgramDraft(DraftSource):
    method = "ngram"

    def __init__(self, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = DEFAULT_MIN_NGRAM):
        assert 1 <= min_ngram <= max_ngram
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [
            lookup(
                np.asarray(r.token_ids, dtype=np.int64),
                r.max_tokens,
                self.max_ngram,
                self.min_ngram,
            )
            if r.max_tokens > 0
            else []
            for r in requests
        ]

    def describe(self) -> str:
        return f"ngram (prompt lookup, n = {self.max_ngram}..{self.min_ngram})"
