"""The engine's request vocabulary: what a client submits (EngineRequest), the events it gets
back (Started, then Deltas, then exactly one Finished), and the figures of a finished request
and of the engine's lifetime. Plain dataclasses: transport code (server.py) converts them to
and from protobuf at its edge.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.common.counters import ByPhase, CacheCounters
from services.engine.grammar import OutputConstraint
from services.engine.sampling import SamplingConfig


class InvalidRequest(ValueError):
    """The request cannot be served as asked (the client must change it). `param`: the request
    field at fault, as the OpenAI error envelope names it, where one is; `code`: its error
    code."""

    def __init__(self, message: str, param: str | None = None,
                 code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class PromptTooLong(InvalidRequest):
    def __init__(self, prompt_tokens: int, context_window: int):
        super().__init__(
            f"prompt is {prompt_tokens} tokens but the model's context window is "
            f"{context_window} tokens; shorten the prompt by at least "
            f"{prompt_tokens - context_window + 1} tokens")
        self.prompt_tokens = prompt_tokens
        self.context_window = context_window


@dataclass(frozen=True)
class GenerateParams:
    max_tokens: int = 0  # 0: up to the context window
    stop: tuple[str, ...] = ()
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    logprobs: bool = False  # report the sampled token's log-probability
    top_logprobs: int = 0  # and this many most likely alternatives
    ignore_eos: bool = False  # EOS does not end the sequence (it is generated as any token)
    stop_token_ids: tuple[int, ...] = ()  # these end it as EOS does (finish reason "stop")
    constraint: OutputConstraint | None = None  # the output must match it (grammar.py)
    # a completion prompt's own tokens come back first (an Echo event): their text, and with
    # logprobs each token's log-probability given the ones before it (top_logprobs
    # alternatives too); every prompt position is computed (no prefix reuse)
    echo: bool = False
    echo_only: bool = False  # with echo: no token generated (OpenAI's max_tokens 0)


@dataclass(frozen=True)
class ChatTurn:
    """A chat message with what the tools of a conversation add to one."""

    role: str
    content: str
    tool_calls: tuple[tuple[str, str, str], ...] = ()  # (id, name, arguments JSON), assistant
    tool_call_id: str = ""  # role "tool"
    name: str = ""  # OpenAI's participant name (Tokenizer.named_roles: where a template shows it)
    reasoning_content: str = ""  # role "assistant": its reasoning, as Strata returned it

    def as_template_message(self, arguments_as_object: bool = False) -> dict:
        """The message a chat template takes; arguments_as_object: each call's arguments as
        the object its JSON text holds (templates that iterate them: GLM's)."""
        message: dict = {"role": self.role, "content": self.content}
        if self.name:
            message["name"] = self.name
        if self.reasoning_content:  # the template decides which turns' reasoning it keeps
            # under both names templates read it by: Qwen3's and DeepSeek's reasoning_content,
            # gpt-oss's thinking (its analysis channel, kept for a turn that made calls)
            message["reasoning_content"] = message["thinking"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": i, "type": "function", "function": {
                    "name": n, "arguments": json.loads(a) if arguments_as_object else a}}
                for i, n, a in self.tool_calls]
        if self.tool_call_id:
            message["tool_call_id"] = self.tool_call_id
        return message


@dataclass(frozen=True)
class ToolSpec:
    """A request's tools: rendered by the chat template; "required", a function's name or a
    `strict` function hold the output to the template's tool-call syntax
    (grammar.tool_call_constraint)."""

    tools_json: str  # the OpenAI `tools` array, as JSON text
    choice: str = "auto"  # "auto" | "required" | a function name
    parallel: bool = True
    allowed: tuple[str, ...] = ()  # the functions the answer may call (OpenAI's allowed_tools)

    @property
    def callable_json(self) -> str:
        """The tools the answer may call (`allowed`, else all), as JSON text: what a grammar
        holds the calls to, while the template renders them all."""
        if not self.allowed:
            return self.tools_json
        return json.dumps([t for t in json.loads(self.tools_json)
                           if t.get("function", {}).get("name") in self.allowed])

    @property
    def strict(self) -> bool:
        """Some function asks for calls that always follow its parameters (OpenAI's
        `function.strict`)."""
        return any(t.get("function", {}).get("strict") is True
                   for t in json.loads(self.tools_json))


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    params: GenerateParams
    # chat-templated: (role, content) pairs or ChatTurns
    messages: tuple[tuple[str, str] | ChatTurn, ...] | None = None
    prompt: str | tuple[int, ...] | None = None  # raw completion prompt: text, or token ids
    tools: ToolSpec | None = None
    following: int = 0  # requests the sender sends next (GenerateRequest.following)
    # a chat's template variables beyond messages and tools: (name, JSON value) pairs
    # (chat_template_kwargs), and the template's `reasoning_effort` ("": its default)
    template_kwargs: tuple[tuple[str, Any], ...] = ()
    reasoning_effort: str = ""
    suffix: str = ""  # a text prompt's: fill in the middle between the two


class _DraftFigures:
    """The acceptance rate of the speculation counters a stats class declares."""

    drafts_proposed: int
    drafts_accepted: int

    @property
    def draft_acceptance_rate(self) -> float:
        p = self.drafts_proposed
        return self.drafts_accepted / p if p else 0.0


@dataclass(frozen=True)
class RequestStats(ByPhase, _DraftFigures):
    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    ttft_ms: float = 0.0
    decode_tok_s: float = 0.0
    # The request's expert-cache counters: its decode tokens', and its prompt's.
    decode: CacheCounters = field(default_factory=CacheCounters)
    prefill: CacheCounters = field(default_factory=CacheCounters)
    # Speculative decoding: draft tokens proposed / accepted, verification steps, decode
    # lookups spent on rejected draft positions, lookups by the draft source's own forward.
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    verify_steps: int = 0
    rejected_lookups: int = 0
    draft_lookups: int = 0
    # Constrained decoding: masks computed, the time llguidance spent on them (beside the
    # forward) and the time the sampler still waited for them.
    grammar_masks: int = 0
    grammar_compute_ms: float = 0.0
    grammar_wait_ms: float = 0.0


@dataclass(frozen=True)
class Started:
    prompt_tokens: int
    context_window: int
    # how the output writes tool calls, when the request has tools (a channeled format's, for
    # every chat request: the gateway splits its answer)
    tool_call_format: str = ""


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float
    token_bytes: bytes


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    token_bytes: bytes
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class Delta:
    """What one engine step produced for a request: its text (held back only where it might
    begin a stop string or an unfinished UTF-8 character) and its tokens, one or several (a
    verified draft)."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()

    @staticmethod
    def join(deltas: Sequence[Delta]) -> Delta:
        """Consecutive deltas as one (for a reader that fell behind)."""
        if len(deltas) == 1:
            return deltas[0]
        return Delta("".join(d.text for d in deltas),
                     tuple(t for d in deltas for t in d.token_ids),
                     tuple(lp for d in deltas for lp in d.logprobs))


@dataclass(frozen=True)
class TokenizerInfo:
    """The tokenizer as clients building prompts need it (Engine.tokenizer_info)."""

    bos_token: str  # empty: none
    eos_token: str
    eos_token_ids: tuple[int, ...]
    chat_template: str  # empty: none
    vocab_size: int
    context_window: int


@dataclass(frozen=True)
class Echo:
    """A prompt's own text and tokens, before the request's first Delta (GenerateParams.echo).
    `logprobs`, with logprobs asked for: one per prompt token, the first of which has nothing
    before it (logprob 0, no alternatives: OpenAI shows null)."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" | "length" | "abort"
    stats: RequestStats
    error: str = ""


Event = Started | Echo | Delta | Finished
Sink = Callable[[Event], None]


@dataclass
class RequestHandle:
    request: EngineRequest
    prompt_ids: list[int]
    sink: Sink
    submitted_at: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass
class EngineTotals(ByPhase, _DraftFigures):
    """Lifetime figures of the finished requests, written by the loop thread only."""

    requests_finished: int = 0
    tokens_generated: int = 0
    decode: CacheCounters = field(default_factory=CacheCounters)
    prefill: CacheCounters = field(default_factory=CacheCounters)
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    verify_steps: int = 0
    rejected_lookups: int = 0
    draft_lookups: int = 0
    grammar_masks: int = 0
    grammar_compute_ms: float = 0.0
    grammar_wait_ms: float = 0.0

    def add(self, stats: RequestStats) -> None:
        """Count one finished request: its tokens, cache counters and speculation figures."""
        self.requests_finished += 1
        self.tokens_generated += stats.completion_tokens
        self.decode.add(stats.decode)
        self.prefill.add(stats.prefill)
        for name in ("drafts_proposed", "drafts_accepted", "verify_steps", "rejected_lookups",
                     "draft_lookups", "grammar_masks", "grammar_compute_ms", "grammar_wait_ms"):
            setattr(self, name, getattr(self, name) + getattr(stats, name))
