"""MTP drafts: the checkpoint's multi-token-prediction head (mtp_head.py) proposes k tokens.

    runner.step  --hidden_sink-->  per sequence: the main model's last W+ hidden states (before
                                   the final norm) and the tokens they were computed for
    propose:     x_0 .. x_n with x_n not yet run; h_i from the main model:
                 d1 = head(h_{n-W..n-1}, emb(x_{n-W+1..n}))[-1]   -> final norm -> lm_head
                 d2 = head(.., h_{n-1}; g_{n-1}, emb(.., x_n; d1))[-1]  (g: the head's own
                 hidden stands in for the main model's, DeepSeek-style reuse of one head) ...

No KV cache for the head: every draft recomputes it over the last W positions (its attention
window; W = 16 rows of a one-block head cost next to nothing beside the main model's expert
traffic). All sequences of a step share one batched head forward per draft (left padding).
Hidden states are checked against the tokens: rows of rejected drafts, or of tokens that
changed, are dropped, so a draft only ever reads states of the sequence's real tokens. The head
has no experts: its expert lookups are zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from services.engine.sampling import argmax_ids
from services.engine.spec.base import DraftRequest, DraftSource
from services.engine.spec.mtp_head import MtpHead, load_mtp_config, load_mtp_head

KEEP_EXTRA = 8  # hidden rows kept beyond the window (the verification's rows land here)


def mtp_head_bytes(model_dir: Any, dtype: torch.dtype = torch.float32) -> int:
    """Device bytes of the checkpoint's MTP head (ValueError when it has none)."""
    config = load_mtp_config(model_dir)
    return config.num_params() * torch.empty((), dtype=dtype).element_size()


@dataclass
class _History:
    start: int = 0  # position of the first kept row
    tokens: list[int] = field(default_factory=list)  # the token each kept row was computed for
    hidden: torch.Tensor | None = None  # [n, D] main-model hidden states at those positions

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


class MtpDraft(DraftSource):
    method = "mtp"

    def __init__(self, runner: Any, head: MtpHead):
        self.runner = runner  # services.engine.runner.ModelRunner of the main model
        self.head = head
        self.memory_bytes = head.config.num_params() * runner.model.weight_dtype.itemsize
        self.keep = head.config.window + KEEP_EXTRA
        self._seqs: dict[int, _History] = {}
        runner.hidden_sink = self.record

    @classmethod
    def load(cls, runner: Any) -> MtpDraft:
        head = load_mtp_head(runner.model_dir, runner.device, runner.dtype)
        return cls(runner, head)

    def describe(self) -> str:
        c = self.head.config
        return (f"MTP head of {self.runner.model_name} (1 block, window {c.window}, "
                f"{self.memory_bytes / 2**20:.1f} MiB)")

    def release(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    def record(self, chunks: Sequence[Any], hidden: torch.Tensor) -> None:
        """The runner's hidden sink: keep each sequence's last rows (hidden [T, D])."""
        row = 0
        for chunk in chunks:
            n = len(chunk.token_ids)
            if chunk.seq_id is not None:
                self._append(chunk.seq_id, chunk.pos_start, list(chunk.token_ids),
                             hidden[row:row + n])
            row += n

    def _append(self, seq_id: int, pos: int, tokens: list[int], rows: torch.Tensor) -> None:
        st = self._seqs.setdefault(seq_id, _History())
        if st.hidden is None or not st.start <= pos <= st.end:  # a gap: start over
            st.start, st.tokens, st.hidden = pos, tokens, rows
        else:  # rows from pos on are replaced (rejected drafts, recomputed tokens)
            cut = pos - st.start
            st.tokens = st.tokens[:cut] + tokens
            st.hidden = torch.cat([st.hidden[:cut], rows])
        drop = max(0, len(st.tokens) - self.keep)
        if drop:
            st.start += drop
            st.tokens = st.tokens[drop:]
            st.hidden = st.hidden[drop:].clone()  # not a view keeping the whole step alive

    def _context(self, r: DraftRequest) -> tuple[int, torch.Tensor] | None:
        """(first position, hidden rows [m, D]) of the main model's valid states ending at the
        last run position n-1, at most W of them; None when h_{n-1} is not known."""
        st = self._seqs.get(r.seq_id)
        n = len(r.token_ids) - 1
        if st is None or st.hidden is None or not st.start <= n - 1 < st.end:
            return None
        valid = st.start
        while valid < n and st.tokens[valid - st.start] == r.token_ids[valid]:
            valid += 1
        if valid < n:  # a kept row was computed for a token the sequence no longer has
            return None
        first = max(st.start, n - self.head.config.window)
        return first, st.hidden[first - st.start:n - st.start]

    @torch.no_grad()
    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        live = []  # (request index, first position, h rows [m, D], tokens after them)
        for i, r in enumerate(requests):
            ctx = self._context(r) if r.max_tokens > 0 else None
            if ctx is not None:
                first, h = ctx
                live.append((i, first, list(h), list(r.token_ids[first + 1:])))
        rounds = max((requests[i].max_tokens for i, *_ in live), default=0)
        for k in range(rounds):
            active = [s for s in live if requests[s[0]].max_tokens > k]
            g, logits = self._step(active)  # [B, D], [B, V]
            best = argmax_ids(logits)
            for j, (i, _, h, tokens) in enumerate(active):
                token = best[j]
                drafts[i].append(token)
                h.append(g[j])  # the head's hidden stands in for the main model's
                tokens.append(token)
        return drafts

    def _step(self, active: list) -> tuple[torch.Tensor, torch.Tensor]:
        """One batched head forward over each sequence's last W rows -> its last row's hidden
        g [B, D] and fp32 logits [B, V]."""
        W = self.head.config.window
        model, device = self.runner.model, self.runner.device
        B = len(active)
        T = min(W, max(len(h) for _, _, h, _ in active))
        D = model.config.hidden_size
        h_in = torch.zeros(B, T, D, dtype=model.dtype, device=device)  # [B, T, D]
        ids = torch.zeros(B, T, dtype=torch.long)
        positions = torch.zeros(B, T, dtype=torch.long)
        valid = torch.zeros(B, T, dtype=torch.bool)
        for j, (_, first, h, tokens) in enumerate(active):
            m = min(T, len(h))
            h_in[j, T - m:] = torch.stack(h[-m:])
            ids[j, T - m:] = torch.tensor(tokens[-m:])
            end = first + len(h)
            positions[j, T - m:] = torch.arange(end - m, end)
            valid[j, T - m:] = True
        e = model.embed_rows(ids.to(device))  # [B, T, D]
        g = self.head(h_in, e, positions.to(device), valid.to(device))[:, -1]  # [B, D]
        logits = model.logits(g)  # [B, V] through the main model's final norm and lm_head
        logits[:, self.runner.num_usable_tokens:] = float("-inf")
        return g, logits
