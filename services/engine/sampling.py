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
every token it emits. Draws use a per-request torch.Generator on the CPU, so a seeded request
is reproducible regardless of the device or of other requests.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

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
        self._prompt = sorted(set(prompt_ids)) if cfg.repetition_penalty != 1.0 else []
        self._end = torch.tensor(sorted(set(end_ids)), dtype=torch.long) \
            if cfg.min_tokens and end_ids else None
        if cfg.logit_bias:
            self._bias_ids = torch.tensor([i for i, _ in cfg.logit_bias], dtype=torch.long)
            self._bias = torch.tensor([b for _, b in cfg.logit_bias], dtype=torch.float32)
        self._counts: dict[int, int] = {}  # generated token -> times
        self.generated = 0

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
            seen = torch.tensor(sorted(set(self._prompt) | set(self._counts)), dtype=torch.long)
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
            return int(torch.argmax(self.process(logits)))
        return self.draw(self.probs(logits))

    def draw(self, probs: torch.Tensor) -> int:
        """One token id from probs [V] (sums to 1), with this request's generator."""
        return int(torch.multinomial(probs, 1, generator=self._gen))

    def uniform(self) -> float:
        """One draw from U[0, 1) with this request's generator (speculative acceptance)."""
        return float(torch.rand(1, generator=self._gen))

    def probs(self, logits: torch.Tensor, row: int | None = None) -> torch.Tensor:
        """The distribution drawn from: [V] fp32, zero outside the top-k / top-p / min-p
        support (`row`: the verification row it is, for a grammar's mask)."""
        scaled = self.process(logits, row).detach().float().cpu() / self.cfg.temperature  # [V]
        if 0 < self.cfg.top_k < scaled.shape[0]:
            keep = torch.topk(scaled, self.cfg.top_k).indices
            cut = torch.full_like(scaled, float("-inf"))
            cut[keep] = scaled[keep]
            scaled = cut
        probs = torch.softmax(scaled, dim=-1)
        if self.cfg.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above each token
            sorted_p[before >= self.cfg.top_p] = 0.0  # the first token always stays
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
            probs = probs / probs.sum()
        if self.cfg.min_p > 0.0:
            probs = torch.where(probs >= self.cfg.min_p * probs.max(), probs, 0.0)
            probs = probs / probs.sum()
        return probs
