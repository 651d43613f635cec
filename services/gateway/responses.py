"""OpenAI response bodies and stream chunks for chat and text completions (pure dicts)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


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
        }

    def headers(self) -> dict[str, str]:
        return {"x-strata-" + k.replace("_", "-"): str(v) for k, v in self.as_dict().items()}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


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

    def full(self, text: str, finish_reason: str, usage_: dict[str, int],
             figures: Figures) -> dict[str, Any]:
        return {**self._base(self.object_full), "choices": [self._full_choice(text, finish_reason)],
                "usage": usage_, "strata": figures.as_dict()}

    def chunk(self, text: str | None = None, finish_reason: str | None = None,
              first: bool = False, figures: Figures | None = None) -> dict[str, Any]:
        body = {**self._base(self.object_chunk),
                "choices": [self._chunk_choice(text, finish_reason, first)]}
        if figures is not None:
            body["strata"] = figures.as_dict()
        return body

    def usage_chunk(self, usage_: dict[str, int], figures: Figures) -> dict[str, Any]:
        return {**self._base(self.object_chunk), "choices": [], "usage": usage_,
                "strata": figures.as_dict()}

    def _full_choice(self, text: str, finish_reason: str) -> dict[str, Any]:
        raise NotImplementedError

    def _chunk_choice(self, text: str | None, finish_reason: str | None,
                      first: bool) -> dict[str, Any]:
        raise NotImplementedError


class ChatRenderer(Renderer):
    id_prefix = "chatcmpl"
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def _full_choice(self, text: str, finish_reason: str) -> dict[str, Any]:
        return {"index": 0, "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason, "logprobs": None}

    def _chunk_choice(self, text: str | None, finish_reason: str | None,
                      first: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if text is not None:
            delta["content"] = text
        return {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}


class CompletionRenderer(Renderer):
    id_prefix = "cmpl"
    object_full = "text_completion"
    object_chunk = "text_completion"

    def _full_choice(self, text: str, finish_reason: str) -> dict[str, Any]:
        return {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}

    def _chunk_choice(self, text: str | None, finish_reason: str | None,
                      first: bool) -> dict[str, Any]:
        return {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
