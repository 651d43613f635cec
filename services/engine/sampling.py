"""Token sampling: the logits processed, then greedy at temperature 0, otherwise temperature ->
top-k -> top-p -> min-p -> draw.

Processing, in vLLM's order (each off at its neutral value):

    logit_bias           logits[id] += bias (OpenAI's; -100 / 100 ban or force in practice)
    min_tokens           the ids that would end the sequence (EOS, stop_token_ids) are masked
                         until this many tokens were generated
    repetition_penalty   a token seen in the prompt or the output: logit / p if > 0, else * p
    frequency_penalty    logit -= f * (times the token was generated)
    presence_penalty     logit -= p * (1 if it was generated at all)
    guide                a token the request's grammar cannot take next: -inf (grammar.py;
                         last, so that nothing outside the grammar can win)

The penalties read the request's own history, so a Sampler is per request: observe() is told
every token it emits. Top-p keeps each token whose more probable tokens' mass is below top_p
(equally probable tokens all in or all out). A draw is one uniform number from a per-request
torch.Generator on the CPU, inverted through the support's cumulative sum, so a seeded request
is reproducible regardless of the device or of other requests.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from services.engine.grammar import Guide


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None
    min_p: float = 0.0  # keep tokens with p >= min_p * the most likely one's
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    min_tokens: int = 0  # no end of sequence before this many tokens

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def history_dependent(self) -> bool:
        """Whether processing reads the tokens generated so far (then a verification step's
        rows would each need their own history: such requests decode without drafts)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0 or self.min_tokens > 0)

    @property
    def processes(self) -> bool:
        return self.history_dependent or bool(self.logit_bias)


def argmax_ids(logits: torch.Tensor) -> list[int]:
    """logits [V] or [R, V] -> each row's highest id (the first of equals; a NaN counts as the
    highest), as torch.argmax picks it. On the CPU through numpy's vectorized argmax: a
    32000-token row in 4 us against torch's 51, a 151936-token one in 12 against 234."""
    if logits.device.type != "cpu":
        return torch.argmax(logits, dim=-1).reshape(-1).tolist()
    rows = logits.detach().float().numpy()
    return np.argmax(rows, axis=-1).reshape(-1).tolist()


def top_ids(logits: torch.Tensor, k: int) -> list[int]:
    """logits [V] -> the ids of its k highest, highest first (equals by id). On the CPU
    through numpy's partition: 170 us at 151936 tokens against torch.topk's 280."""
    k = min(k, logits.shape[-1])
    if logits.device.type != "cpu":
        return torch.topk(logits, k).indices.tolist()
    x = logits.detach().float().numpy()
    ids = np.argpartition(x, x.shape[0] - k)[x.shape[0] - k:]
    return ids[np.lexsort((ids, -x[ids]))].tolist()


class Sampler:
    def __init__(self, cfg: SamplingConfig, prompt_ids: Iterable[int] = (),
                 end_ids: Iterable[int] = (), guide: Guide | None = None):
        """prompt_ids: what repetition_penalty counts besides the output; end_ids: the ids
        that end the sequence (EOS, stop_token_ids), masked before min_tokens; guide: the
        request's grammar (constrained decoding), told every token taken."""
        self.cfg = cfg
        self.guide = guide
        self.rows: torch.Tensor | None = None  # a verification's row masks (guide.row_masks)
        # Made when first drawn from (a greedy request never does), and the tensors only when
        # their option is set: a Sampler took 13.7 us to make, on the gRPC thread, now 0.3.
        self._generator: torch.Generator | None = None
        # repetition_penalty's tokens: the prompt's and the output's so far, each once (the
        # tensor grows by a token the first time it is seen: no set rebuilt a token)
        self._seen = set(prompt_ids) if cfg.repetition_penalty != 1.0 else set()
        self._seen_ids = torch.tensor(sorted(self._seen), dtype=torch.long)
        self._end = torch.tensor(sorted(set(end_ids)), dtype=torch.long) \
            if cfg.min_tokens and end_ids else None
        if cfg.logit_bias:
            self._bias_ids = torch.tensor([i for i, _ in cfg.logit_bias], dtype=torch.long)
            self._bias = torch.tensor([b for _, b in cfg.logit_bias], dtype=torch.float32)
        self._counts: dict[int, int] = {}  # generated token -> times
        self.generated = 0

    @property
    def plain_greedy(self) -> bool:
        """Whether sample() is the argmax of the logits as they come: greedy, nothing to
        process, no grammar (then a step's rows can be picked together: argmax_ids)."""
        return self.cfg.greedy and not self.cfg.processes and self.guide is None

    @property
    def _gen(self) -> torch.Generator:
        """This request's generator: `seed`'s stream, or seeded from the OS's entropy."""
        if self._generator is None:
            self._generator = torch.Generator(device="cpu")
            if self.cfg.seed is None:
                self._generator.seed()
            else:
                self._generator.manual_seed(self.cfg.seed)
        return self._generator

    def observe(self, token_id: int) -> None:
        """The request emitted token_id (its history for the penalties and min_tokens)."""
        self.generated += 1
        if self.cfg.history_dependent:
            self._counts[token_id] = self._counts.get(token_id, 0) + 1
            if self.cfg.repetition_penalty != 1.0 and token_id not in self._seen:
                self._seen.add(token_id)
                self._seen_ids = torch.cat([self._seen_ids, torch.tensor([token_id])])
        if self.guide is not None:
            self.guide.consume(token_id)

    def process(self, logits: torch.Tensor, row: int | None = None) -> torch.Tensor:
        """logits [V] or [R, V] -> processed fp32 CPU logits (each row with the same
        history, and with a grammar the mask of its row of a verification: `rows`, or for
        one row of it `row`); unchanged when nothing is configured."""
        cfg = self.cfg
        if not cfg.processes and self.guide is None:
            return logits
        out = logits.detach().float().cpu().clone()
        if cfg.logit_bias:  # ids within the vocabulary: the engine refuses others at submit
            out[..., self._bias_ids] += self._bias
        if self.generated < cfg.min_tokens and self._end is not None:
            out[..., self._end] = float("-inf")
        if cfg.repetition_penalty != 1.0:
            seen = self._seen_ids
            if len(seen):
                picked = out[..., seen]
                out[..., seen] = torch.where(picked > 0, picked / cfg.repetition_penalty,
                                             picked * cfg.repetition_penalty)
        if self._counts and (cfg.frequency_penalty or cfg.presence_penalty):
            ids = torch.tensor(list(self._counts), dtype=torch.long)
            counts = torch.tensor(list(self._counts.values()), dtype=torch.float32)
            out[..., ids] -= cfg.frequency_penalty * counts + cfg.presence_penalty
        if self.guide is not None:
            if self.rows is None:
                allowed = self.guide.allowed()
            else:
                allowed = self.rows[:out.shape[0]] if out.dim() == 2 else self.rows[row or 0]
            vocab = allowed.shape[-1]
            out[..., :vocab].masked_fill_(~allowed, float("-inf"))
            out[..., vocab:] = float("-inf")
        return out

    def sample(self, logits: torch.Tensor) -> int:
        """logits [V] -> one token id."""
        if self.cfg.greedy:
            [token_id] = argmax_ids(self.process(logits))
            return token_id
        ids, p = self._support(logits)
        return int(ids[self._pick(p)]) if ids is not None else self._pick(p)

    def draw(self, probs: torch.Tensor) -> int:
        """One token id from probs [V] (sums to 1), with this request's generator."""
        return self._pick(probs.detach().float().cpu().numpy())

    def uniform(self) -> float:
        """One draw from U[0, 1) with this request's generator (speculative acceptance)."""
        return float(torch.rand(1, generator=self._gen))

    def probs(self, logits: torch.Tensor, row: int | None = None) -> torch.Tensor:
        """The distribution drawn from: [V] fp32, zero outside the top-k / top-p / min-p
        support (`row`: the verification row it is, for a grammar's mask)."""
        ids, w = self._support(logits, row)
        p = torch.from_numpy(w / w.sum())
        if ids is None:
            return p
        dense = torch.zeros(logits.shape[-1], dtype=torch.float32)
        dense[torch.from_numpy(ids)] = p
        return dense

    def _support(self, logits: torch.Tensor, row: int | None = None
                 ) -> tuple[np.ndarray | None, np.ndarray]:
        """The distribution as (ids, w): the tokens it may draw and weights proportional to
        their probabilities (float32, the most probable 1); ids None: w is over the whole
        vocabulary. Nothing here sorts the vocabulary: top-k partitions it, top-p sorts only
        the most probable tokens, as many as its mass needs (torch.sort and
        torch.multinomial took 11 and 3 ms a row at 151936 tokens)."""
        cfg = self.cfg
        x = self.process(logits, row).detach().float().cpu().numpy()  # [V] (maybe the caller's)
        V = x.shape[0]
        ids = None
        if 0 < cfg.top_k < V:
            ids = np.argpartition(x, V - cfg.top_k)[V - cfg.top_k:]
            x = x[ids]
        highest = x.max()  # NaN if any is
        if not np.isfinite(highest):
            raise ValueError(f"no token can be drawn: the highest logit is {highest}")
        w = x - highest
        if cfg.temperature != 1.0:
            w /= cfg.temperature
        np.exp(w, out=w)
        if cfg.top_p < 1.0:
            keep = _nucleus(w, cfg.top_p * float(w.sum()))
            ids = keep if ids is None else ids[keep]
            w = w[keep]
        if cfg.min_p > 0.0:  # of the most probable's weight, 1
            keep = np.flatnonzero(w >= cfg.min_p)
            ids = keep if ids is None else ids[keep]
            w = w[keep]
        return ids, w

    def _pick(self, w: np.ndarray) -> int:
        """An index of w (weights, float32) drawn with this request's generator: one uniform
        number through the inverse of their cumulative sum (float64): over blocks of
        _PICK_BLOCK first, then within the block it falls in (a cumulative sum of the whole
        vocabulary cost 6x). A zero weight never is picked; ValueError when nothing can be
        (all zero, or NaN)."""
        n = len(w)
        full = n // _PICK_BLOCK * _PICK_BLOCK
        sums = w[:full].reshape(-1, _PICK_BLOCK).sum(axis=1, dtype=np.float64)
        if full < n:
            sums = np.append(sums, w[full:].sum(dtype=np.float64))
        ends = np.cumsum(sums)  # [blocks] the mass up to each block's end
        total = ends[-1] if len(ends) else 0.0
        if not total > 0.0:
            raise ValueError(f"no token can be drawn: the weights sum to {total}")
        x = float(torch.rand(1, generator=self._gen, dtype=torch.float64)) * total
        b = min(int(np.searchsorted(ends, x, side="right")), len(ends) - 1)
        while sums[b] == 0.0:  # only past the end, by rounding: the last block with mass
            b -= 1
        first = b * _PICK_BLOCK
        block = w[first:first + _PICK_BLOCK]
        cdf = np.cumsum(block.astype(np.float64))
        i = int(np.searchsorted(cdf, x - (ends[b - 1] if b else 0.0), side="right"))
        if i >= len(block):  # rounding again: the block's last token with weight
            i = int(np.flatnonzero(block)[-1])
        return first + i


_PICK_BLOCK = 1024  # weights summed per block by _pick before it reads one block's cumsum


def _nucleus(w: np.ndarray, mass: float) -> np.ndarray:
    """Top-p over weights w [N] (mass: top_p of their sum) -> the indices kept: each token
    whose more probable tokens' weight is < mass (the most probable always; equals all in or
    all out). Sorts the values of the 256 heaviest, 8 times more while all of them stay in;
    no indices are sorted (numpy's argsort is 5x its sort)."""
    n = w.shape[0]
    m = min(n, 256)
    while True:
        top = np.sort(np.partition(w, n - m)[n - m:] if m < n else w)[::-1]  # [m] descending
        before = np.cumsum(top.astype(np.float64)) - top  # the weight above each
        kept = int(np.count_nonzero(before < mass))  # a prefix: `before` never decreases
        if m == n or kept < m:  # the cut falls within these: the rest are out too
            return np.flatnonzero(w >= top[kept - 1])
        m = min(n, m * 8)
