from services.common.pb.strata.v1 import counters_pb2 as _counters_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "chat")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: ChatInput
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[ChatInput, _Mapping]] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class GetTokenizerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizerInfo(_message.Message):
    __slots__ = ("bos_token", "eos_token", "eos_token_ids", "chat_template", "vocab_size", "context_window", "model")
    BOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_WINDOW_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    bos_token: str
    eos_token: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    chat_template: str
    vocab_size: int
    context_window: int
    model: str
    def __init__(self, bos_token: _Optional[str] = ..., eos_token: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., chat_template: _Optional[str] = ..., vocab_size: _Optional[int] = ..., context_window: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "name", "reasoning_content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    name: str
    reasoning_content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ..., reasoning_content: _Optional[str] = ...) -> None: ...

class ChatInput(_message.Message):
    __slots__ = ("messages", "tools_json", "tool_choice", "parallel_tool_calls", "template_kwargs_json", "reasoning_effort", "allowed_tools")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    REASONING_EFFORT_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOOLS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tools_json: str
    tool_choice: str
    parallel_tool_calls: bool
    template_kwargs_json: str
    reasoning_effort: str
    allowed_tools: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., tools_json: _Optional[str] = ..., tool_choice: _Optional[str] = ..., parallel_tool_calls: _Optional[bool] = ..., template_kwargs_json: _Optional[str] = ..., reasoning_effort: _Optional[str] = ..., allowed_tools: _Optional[_Iterable[str]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p", "min_tokens", "ignore_eos", "stop_token_ids", "echo", "echo_only")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    ECHO_ONLY_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    logprobs: bool
    top_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_p: float
    min_tokens: int
    ignore_eos: bool
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    echo: bool
    echo_only: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., echo: _Optional[bool] = ..., echo_only: _Optional[bool] = ...) -> None: ...

class OutputConstraint(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "lark")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    LARK_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    lark: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., lark: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "chat", "prompt", "prompt_token_ids", "sampling", "stream_interval_ms", "constraint", "following", "suffix")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    FOLLOWING_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chat: ChatInput
    prompt: str
    prompt_token_ids: TokenIds
    sampling: SamplingParams
    stream_interval_ms: float
    constraint: OutputConstraint
    following: int
    suffix: str
    def __init__(self, request_id: _Optional[str] = ..., chat: _Optional[_Union[ChatInput, _Mapping]] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stream_interval_ms: _Optional[float] = ..., constraint: _Optional[_Union[OutputConstraint, _Mapping]] = ..., following: _Optional[int] = ..., suffix: _Optional[str] = ...) -> None: ...

class Started(_message.Message):
    __slots__ = ("prompt_tokens", "context_window", "engine_id", "tool_call_format")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_WINDOW_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_FORMAT_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    context_window: int
    engine_id: str
    tool_call_format: str
    def __init__(self, prompt_tokens: _Optional[int] = ..., context_window: _Optional[int] = ..., engine_id: _Optional[str] = ..., tool_call_format: _Optional[str] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "bytes")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    bytes: bytes
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., bytes: _Optional[bytes] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "bytes", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    bytes: bytes
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., bytes: _Optional[bytes] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("text", "token_ids", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class RequestStats(_message.Message):
    __slots__ = ("prompt_tokens", "reused_prompt_tokens", "completion_tokens", "queue_ms", "prefill_ms", "decode_ms", "ttft_ms", "decode_tok_s", "decode", "prefill", "drafts_proposed", "drafts_accepted", "draft_acceptance_rate", "verify_steps", "rejected_lookups", "draft_lookups")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REUSED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOK_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    reused_prompt_tokens: int
    completion_tokens: int
    queue_ms: float
    prefill_ms: float
    decode_ms: float
    ttft_ms: float
    decode_tok_s: float
    decode: _counters_pb2.CacheCounters
    prefill: _counters_pb2.CacheCounters
    drafts_proposed: int
    drafts_accepted: int
    draft_acceptance_rate: float
    verify_steps: int
    rejected_lookups: int
    draft_lookups: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., reused_prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., queue_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., decode_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., decode_tok_s: _Optional[float] = ..., decode: _Optional[_Union[_counters_pb2.CacheCounters, _Mapping]] = ..., prefill: _Optional[_Union[_counters_pb2.CacheCounters, _Mapping]] = ..., drafts_proposed: _Optional[int] = ..., drafts_accepted: _Optional[int] = ..., draft_acceptance_rate: _Optional[float] = ..., verify_steps: _Optional[int] = ..., rejected_lookups: _Optional[int] = ..., draft_lookups: _Optional[int] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("reason", "stats", "error")
    REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    reason: FinishReason
    stats: RequestStats
    error: str
    def __init__(self, reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[RequestStats, _Mapping]] = ..., error: _Optional[str] = ...) -> None: ...

class PromptEcho(_message.Message):
    __slots__ = ("text", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("started", "delta", "finished", "echo")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    started: Started
    delta: TokenDelta
    finished: Finished
    echo: PromptEcho
    def __init__(self, started: _Optional[_Union[Started, _Mapping]] = ..., delta: _Optional[_Union[TokenDelta, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ..., echo: _Optional[_Union[PromptEcho, _Mapping]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CacheStatus(_message.Message):
    __slots__ = ("slots", "total_pairs", "coverage", "slot_bytes", "device_memory_bytes", "reserved_bytes", "plan_version", "plan_source", "decode", "prefill", "policy", "pinned_slots", "dynamic_slots", "placement", "link_gb_s", "host_expert_tokens_s", "prefetch", "evictions", "distinct_pairs_routed", "layer_steps", "weight_bytes", "kv_bytes", "draft_bytes")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAIRS_FIELD_NUMBER: _ClassVar[int]
    COVERAGE_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    PLAN_SOURCE_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PINNED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    LINK_GB_S_FIELD_NUMBER: _ClassVar[int]
    HOST_EXPERT_TOKENS_S_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    DISTINCT_PAIRS_ROUTED_FIELD_NUMBER: _ClassVar[int]
    LAYER_STEPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BYTES_FIELD_NUMBER: _ClassVar[int]
    slots: int
    total_pairs: int
    coverage: float
    slot_bytes: int
    device_memory_bytes: int
    reserved_bytes: int
    plan_version: int
    plan_source: str
    decode: _counters_pb2.CacheCounters
    prefill: _counters_pb2.CacheCounters
    policy: str
    pinned_slots: int
    dynamic_slots: int
    placement: str
    link_gb_s: float
    host_expert_tokens_s: float
    prefetch: bool
    evictions: int
    distinct_pairs_routed: int
    layer_steps: int
    weight_bytes: int
    kv_bytes: int
    draft_bytes: int
    def __init__(self, slots: _Optional[int] = ..., total_pairs: _Optional[int] = ..., coverage: _Optional[float] = ..., slot_bytes: _Optional[int] = ..., device_memory_bytes: _Optional[int] = ..., reserved_bytes: _Optional[int] = ..., plan_version: _Optional[int] = ..., plan_source: _Optional[str] = ..., decode: _Optional[_Union[_counters_pb2.CacheCounters, _Mapping]] = ..., prefill: _Optional[_Union[_counters_pb2.CacheCounters, _Mapping]] = ..., policy: _Optional[str] = ..., pinned_slots: _Optional[int] = ..., dynamic_slots: _Optional[int] = ..., placement: _Optional[str] = ..., link_gb_s: _Optional[float] = ..., host_expert_tokens_s: _Optional[float] = ..., prefetch: _Optional[bool] = ..., evictions: _Optional[int] = ..., distinct_pairs_routed: _Optional[int] = ..., layer_steps: _Optional[int] = ..., weight_bytes: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., draft_bytes: _Optional[int] = ...) -> None: ...

class SpecStatus(_message.Message):
    __slots__ = ("method", "spec_tokens", "drafts_proposed", "drafts_accepted", "acceptance_rate", "verify_steps", "rejected_lookups", "draft_lookups")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    SPEC_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    method: str
    spec_tokens: int
    drafts_proposed: int
    drafts_accepted: int
    acceptance_rate: float
    verify_steps: int
    rejected_lookups: int
    draft_lookups: int
    def __init__(self, method: _Optional[str] = ..., spec_tokens: _Optional[int] = ..., drafts_proposed: _Optional[int] = ..., drafts_accepted: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., verify_steps: _Optional[int] = ..., rejected_lookups: _Optional[int] = ..., draft_lookups: _Optional[int] = ...) -> None: ...

class EngineStatus(_message.Message):
    __slots__ = ("engine_id", "model", "ready", "running", "waiting", "context_window", "device", "requests_finished", "tokens_generated", "cache", "kv_blocks_total", "kv_blocks_free", "max_running", "spec")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_WINDOW_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    model: str
    ready: bool
    running: int
    waiting: int
    context_window: int
    device: str
    requests_finished: int
    tokens_generated: int
    cache: CacheStatus
    kv_blocks_total: int
    kv_blocks_free: int
    max_running: int
    spec: SpecStatus
    def __init__(self, engine_id: _Optional[str] = ..., model: _Optional[str] = ..., ready: _Optional[bool] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., context_window: _Optional[int] = ..., device: _Optional[str] = ..., requests_finished: _Optional[int] = ..., tokens_generated: _Optional[int] = ..., cache: _Optional[_Union[CacheStatus, _Mapping]] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., max_running: _Optional[int] = ..., spec: _Optional[_Union[SpecStatus, _Mapping]] = ...) -> None: ...
