"""OpenAI response bodies and stream chunks for chat and text completions (pure dicts)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.gateway.engine_client import TokenLogprob
    from services.gateway.tools import ToolCall

# Sampled-token log-probabilities for one choice; None when the request did not ask for them.
Logprobs = Sequence["TokenLogprob"] | None


@dataclass(frozen=True)
class Figures:
    """Per-request Strata figures, reported in the `strata` field and x-strata-* headers."""

    engine_id: str
    queue_wait_ms: float  # waiting for a gateway admission slot
    ttft_ms: float  # gateway arrival -> first token (includes the wait)
    engine_queue_ms: float
    decode_tok_s: float
    expert_hit_rate: float
    spill_ratio: float
    reused_prompt_tokens: int
    drafts_proposed: int = 0  # speculative decoding: draft tokens proposed / accepted
    drafts_accepted: int = 0
    draft_acceptance_rate: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "queue_wait_ms": round(self.queue_wait_ms, 3),
            "ttft_ms": round(self.ttft_ms, 3),
            "engine_queue_ms": round(self.engine_queue_ms, 3),
            "decode_tok_s": round(self.decode_tok_s, 3),
            "expert_hit_rate": round(self.expert_hit_rate, 4),
            "spill_ratio": round(self.spill_ratio, 4),
            "reused_prompt_tokens": self.reused_prompt_tokens,
            "drafts_proposed": self.drafts_proposed,
            "drafts_accepted": self.drafts_accepted,
            "draft_acceptance_rate": round(self.draft_acceptance_rate, 4),
        }

    def headers(self) -> dict[str, str]:
        return {"x-strata-" + k.replace("_", "-"): str(v) for k, v in self.as_dict().items()}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
          ) -> dict[str, Any]:
    """OpenAI usage; cached_tokens = prompt tokens whose KV the engine reused (prefix reuse)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def logprob_entry(lp: TokenLogprob) -> dict[str, Any]:
    """A token's logprob as the chat API and the Responses API write it: the token, its
    logprob and bytes, and its top alternatives alike."""
    return {"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token_bytes),
            "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.token_bytes)}
                             for t in lp.top]}


class Renderer:
    """Builds one request's bodies; subclasses fix the OpenAI object kind."""

    id_prefix = ""
    object_full = ""
    object_chunk = ""

    def __init__(self, request_id: str, model: str) -> None:
        self.response_id = f"{self.id_prefix}-{request_id}"
        self.model = model
        self.created = int(time.time())

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.response_id, "object": obj, "created": self.created,
                "model": self.model}

    def full(self, text: str, finish_reason: str, usage_: dict[str, int], figures: Figures,
             logprobs: Logprobs = None) -> dict[str, Any]:
        return self.full_many([(text, finish_reason, logprobs)], usage_, figures)

    def full_many(self, choices: Sequence[tuple[str, str, Logprobs]], usage_: dict[str, int],
                  figures: Figures, tool_calls: Sequence[Sequence[ToolCall]] = (),
                  reasoning: Sequence[str] = ()) -> dict[str, Any]:
        """One body for n choices: (text, finish reason, logprobs) each, index in order (and
        each choice's tool calls, for a chat request with tools, and its reasoning, for a
        model that answers with it apart)."""
        out = [{**self._full_choice(text, finish_reason,
                                    tool_calls[index] if tool_calls else (),
                                    reasoning[index] if reasoning else ""),
                "index": index, "logprobs": self._logprobs(logprobs, index)}
               for index, (text, finish_reason, logprobs) in enumerate(choices)]
        return {**self._base(self.object_full), "choices": out, "usage": usage_,
                "strata": figures.as_dict()}

    def chunk(self, text: str | None = None, finish_reason: str | None = None,
              first: bool = False, figures: Figures | None = None,
              logprobs: Logprobs = None, index: int = 0,
              reasoning: str | None = None) -> dict[str, Any]:
        choice = {**self._chunk_choice(text, finish_reason, first), "index": index,
                  "logprobs": self._logprobs(logprobs, index) if logprobs else None}
        if reasoning is not None:  # vLLM's and DeepSeek's field for a reasoning model's thoughts
            choice["delta"]["reasoning_content"] = reasoning
        body = {**self._base(self.object_chunk), "choices": [choice]}
        if figures is not None:
            body["strata"] = figures.as_dict()
        return body

    def tool_call_chunk(self, call: ToolCall, number: int, index: int = 0) -> dict[str, Any]:
        """A streamed tool call, whole: its id, name and arguments in one delta (`number`: the
        call's place among the choice's calls)."""
        return {**self._base(self.object_chunk), "choices": [{
            "index": index, "delta": {"tool_calls": [{"index": number, **call.as_dict()}]},
            "logprobs": None, "finish_reason": None}]}

    def usage_chunk(self, usage_: dict[str, int], figures: Figures) -> dict[str, Any]:
        return {**self._base(self.object_chunk), "choices": [], "usage": usage_,
                "strata": figures.as_dict()}

    def _full_choice(self, text: str, finish_reason: str,
                     tool_calls: Sequence[ToolCall] = (), reasoning: str = "") -> dict[str, Any]:
        raise NotImplementedError

    def _logprobs(self, logprobs: Logprobs, index: int = 0) -> dict[str, Any] | None:
        raise NotImplementedError

    def _chunk_choice(self, text: str | None, finish_reason: str | None,
                      first: bool) -> dict[str, Any]:
        raise NotImplementedError


class ChatRenderer(Renderer):
    id_prefix = "chatcmpl"
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def _full_choice(self, text: str, finish_reason: str,
                     tool_calls: Sequence[ToolCall] = (), reasoning: str = "") -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            message = {"role": "assistant", "content": text or None,
                       "tool_calls": [c.as_dict() for c in tool_calls]}
        if reasoning:
            message["reasoning_content"] = reasoning
        return {"index": 0, "message": message, "finish_reason": finish_reason}

    def _logprobs(self, logprobs: Logprobs, index: int = 0) -> dict[str, Any] | None:
        """OpenAI chat shape: {"content": [{token, logprob, bytes, top_logprobs}], "refusal"}."""
        if logprobs is None:
            return None
        return {"content": [logprob_entry(lp) for lp in logprobs], "refusal": None}

    def _chunk_choice(self, text: str | None, finish_reason: str | None,
                      first: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if text is not None:
            delta["content"] = text
        return {"index": 0, "delta": delta, "finish_reason": finish_reason}


class CompletionRenderer(Renderer):
    id_prefix = "cmpl"
    object_full = "text_completion"
    object_chunk = "text_completion"

    def __init__(self, request_id: str, model: str) -> None:
        super().__init__(request_id, model)
        self._text_offset: dict[int, int] = {}  # choice -> characters its logprobs described

    def _full_choice(self, text: str, finish_reason: str,
                     tool_calls: Sequence[ToolCall] = (), reasoning: str = "") -> dict[str, Any]:
        return {"index": 0, "text": text, "finish_reason": finish_reason}

    def _chunk_choice(self, text: str | None, finish_reason: str | None,
                      first: bool) -> dict[str, Any]:
        return {"index": 0, "text": text or "", "finish_reason": finish_reason}

    def _logprobs(self, logprobs: Logprobs, index: int = 0) -> dict[str, Any] | None:
        """Legacy completions shape: parallel lists per token, top alternatives as dicts."""
        if logprobs is None:
            return None
        offsets = []
        for lp in logprobs:
            offsets.append(self._text_offset.get(index, 0))
            self._text_offset[index] = offsets[-1] + len(lp.token)
        return {"tokens": [lp.token for lp in logprobs],
                "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [None if lp.logprob is None else {t.token: t.logprob
                                                                   for t in lp.top}
                                 for lp in logprobs],
                "text_offset": offsets}
