"""OpenAI request bodies -> frozen native types, validated as early as possible.

Anything the engine cannot honour is refused here with an `InvalidRequest` naming the parameter,
so a bad request never reaches an engine slot. A field Strata does not read, in the body or in a
message, is refused by name too (`unsupported_parameter`); a null asks for nothing and passes.
What only the model can tell (whether its chat template shows a message's `name`) the engine
refuses the same way.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from typing import Any

from services.gateway.errors import InvalidRequest, first_unknown, refuse_unknown_keys
from services.gateway.tools import (
    FUNCTION_NAME,
    ToolCall,
    Tools,
    parse_history_calls,
    parse_tools,
)

CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
              "tool": "tool"}
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Bounds on every numeric parameter (the proto fields are int32 / uint64).
MAX_TOKENS_LIMIT = 1 << 20
MAX_TOP_K = 1 << 16
MAX_TOP_LOGPROBS = 20
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256
MAX_MESSAGES = 4096
MAX_CHOICES = 16  # n, times the prompts of a batched completion request
MAX_TOKEN_ID = (1 << 31) - 1  # a prompt's token ids travel as int32; the engine checks its vocabulary
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_STOP_TOKEN_IDS = 64
MAX_REPETITION_PENALTY = 10.0
MAX_GRAMMAR_CHARS = 1 << 16  # a JSON schema, regex or grammar, as text
# vLLM's constrained-decoding fields, which clients written for it send.
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
# The deprecated forms of tools / tool_choice: refused by name, never ignored.
LEGACY_TOOL_FIELDS = ("functions", "function_call")
MAX_USER_CHARS = 256
MAX_CACHE_KEY_CHARS = 256
# The fields each endpoint reads. Any other is refused by name (a request field is implemented
# or refused, never silently ignored); openapi.py's request schemas list exactly these, with
# additionalProperties false (tests/gateway/test_openapi.py holds the two equal).
COMMON_FIELDS = frozenset({
    "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "seed",
    "n", "stop", "presence_penalty", "frequency_penalty", "logit_bias", "repetition_penalty",
    "min_p", "min_tokens", "ignore_eos", "stop_token_ids", "response_format", "user",
    "logprobs", "safety_identifier", "prompt_cache_key", *GUIDED_FIELDS})
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools",
                               "tool_choice", "parallel_tool_calls", "reasoning_effort",
                               "chat_template_kwargs"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "best_of", "suffix"}
STREAM_OPTIONS = frozenset({"include_usage"})
# A chat message's fields (openapi.py's ChatMessage lists exactly these) and a content part's.
MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "refusal",
                            "reasoning_content"})
TEXT_PART_FIELDS = frozenset({"type", "text"})
RESPONSE_FORMAT_FIELDS = frozenset({"type", "json_schema"})  # json_object and text: type alone
JSON_SCHEMA_FIELDS = frozenset({"name", "schema", "strict"})
MAX_NAME_CHARS = 256
# gpt-oss's reasoning efforts (its chat template's `reasoning_effort`)
REASONING_EFFORTS = ("low", "medium", "high")
MAX_TEMPLATE_KWARGS = 32
TEMPLATE_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables
    seed: int | None = None
    max_tokens: int = 0  # 0: up to the context window
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per position, needs logprobs
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    min_p: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Constraint:
    """What the output must match (the engine's OutputConstraint)."""

    kind: str  # json_schema | json_object | regex | lark
    text: str = ""


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's calls, in the history
    tool_call_id: str = ""  # role "tool": the call it answers
    name: str = ""  # the participant's name (the engine refuses it where its template drops it)
    reasoning_content: str = ""  # an assistant's reasoning, as Strata returned it


Prompt = str | tuple[int, ...]  # a completion prompt: text, or token ids taken as they are


@dataclass(frozen=True)
class GenerateInput:
    """One parsed request: either chat messages or raw prompts (one, or a batch)."""

    model: str
    sampling: Sampling
    messages: tuple[Message, ...] = ()
    prompts: tuple[Prompt, ...] = ()  # /v1/completions: each answered with n choices
    stream: bool = False
    include_usage: bool = False
    n: int = 1  # choices per prompt: n engine requests of it (the KV prefix reused)
    constraint: Constraint | None = None
    tools: Tools | None = None
    user: str | None = None  # the caller's end-user id: on the request's trace span (user.id)
    echo: bool = False  # /v1/completions: the prompt comes back before the completion
    echo_only: bool = False  # with echo, max_tokens 0: the prompt alone, nothing generated
    # a chat's template variables: chat_template_kwargs as JSON text ("": none), and
    # reasoning_effort ("": the template's default); the engine refuses what its template
    # does not read
    template_kwargs_json: str = ""
    reasoning_effort: str = ""
    suffix: str = ""  # /v1/completions: fill in the middle between each prompt and this
    # prompt_cache_key: requests with the same key go to the same engine where it has a slot
    # (admission.place), so that their shared prefix is reused there
    cache_key: str | None = None

    @property
    def is_chat(self) -> bool:
        return not self.prompts

    @property
    def prompt_estimate(self) -> int:
        """Prompt tokens estimated once the request is parsed, where its body's size (what
        admission counted) falls short of its prompt; 0: the body says."""
        return 0

    @property
    def placement_key(self) -> str | None:
        """The key that steers the request to an engine (admission.place); None: any."""
        return self.cache_key

    @property
    def prompt(self) -> Prompt | None:
        """The first prompt: a choice's own (see num_choices)."""
        return self.prompts[0] if self.prompts else None

    @property
    def num_choices(self) -> int:
        """Engine requests: n for each prompt (chat: one prompt). Choice i answers prompt
        i // n, in OpenAI's order."""
        return max(len(self.prompts), 1) * self.n


def parse_chat(body: Any) -> GenerateInput:
    body = request_object(body)
    _refuse_unsupported_chat(body)
    _refuse_unknown(body, CHAT_FIELDS, "/v1/chat/completions",
                    COMPLETION_FIELDS, "/v1/completions")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty array of messages", "messages")
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequest(f"at most {MAX_MESSAGES} messages per request", "messages")
    parsed = tuple(_message(m, i) for i, m in enumerate(messages))
    sampling = _sampling(body, _max_tokens_key(body), default_max_tokens=0)
    logprobs = bool_field(body, "logprobs", False)
    top_logprobs = 0
    if body.get("top_logprobs") is not None:
        top_logprobs = int_field(body, "top_logprobs", low=0, high=MAX_TOP_LOGPROBS)
        if top_logprobs and not logprobs:
            raise InvalidRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    constraint, tools = _constraint(body), parse_tools(body)
    if constraint is not None and tools is not None and tools.choice != "auto":
        raise InvalidRequest("'tool_choice' that requires a call and 'response_format' both "
                             "decide the output's form; give one", "tool_choice")
    return GenerateInput(
        model=model_field(body), messages=parsed, **_stream(body), n=_choices(body),
        sampling=replace(sampling, logprobs=logprobs, top_logprobs=top_logprobs),
        constraint=constraint, tools=tools, user=end_user(body), cache_key=cache_key(body),
        template_kwargs_json=template_kwargs(body.get("chat_template_kwargs")),
        reasoning_effort=reasoning_effort(body.get("reasoning_effort"), "reasoning_effort"))


def reasoning_effort(value: Any, param: str) -> str:
    """OpenAI's reasoning effort, as gpt-oss's chat template takes it ("" when not given)."""
    if value is None:
        return ""
    if value not in REASONING_EFFORTS:
        raise InvalidRequest(f"'{param}' must be one of {', '.join(REASONING_EFFORTS)} (the "
                             f"efforts gpt-oss's chat template knows); got {shown(value)}",
                             param)
    return value


def template_kwargs(value: Any) -> str:
    """vLLM's chat_template_kwargs: variables for the chat template, as JSON text ("" when
    none). Whether the model's template reads each is the engine's to say."""
    if value is None or value == {}:
        return ""
    if not isinstance(value, dict) or len(value) > MAX_TEMPLATE_KWARGS:
        raise InvalidRequest(f"'chat_template_kwargs' must be an object of at most "
                             f"{MAX_TEMPLATE_KWARGS} template variables", "chat_template_kwargs")
    for name in value:
        if not TEMPLATE_VARIABLE.fullmatch(name):
            raise InvalidRequest(f"'chat_template_kwargs' names {shown(name)}, which is no "
                                 "template variable (letters, digits, '_')",
                                 f"chat_template_kwargs.{name}")
    return json.dumps(value)


def parse_completion(body: Any) -> GenerateInput:
    body = request_object(body)
    _refuse_unknown(body, COMPLETION_FIELDS, "/v1/completions",
                    CHAT_FIELDS, "/v1/chat/completions")
    prompts, n = _prompts(body.get("prompt")), _choices(body)
    if len(prompts) * n > MAX_CHOICES:
        raise InvalidRequest(f"{len(prompts)} prompts with 'n' {n} ask for {len(prompts) * n} "
                             f"choices; at most {MAX_CHOICES} per request: send fewer prompts "
                             "per request", "prompt")
    echo = bool_field(body, "echo", False)
    top_logprobs = None
    if body.get("logprobs") is not None:  # legacy form: the number of alternatives, 0-20
        top_logprobs = int_field(body, "logprobs", low=0, high=MAX_TOP_LOGPROBS)
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise InvalidRequest("'suffix' must be a string", "suffix")
    if suffix and (echo or any(isinstance(p, tuple) for p in prompts)):
        raise InvalidRequest("'suffix' fills in the middle of text prompts, and comes back "
                             "with no 'echo'" if echo else "'suffix' needs text prompts, not "
                             "token ids", "suffix")
    best_of = body.get("best_of")
    if best_of not in (None, 1):
        raise InvalidRequest("'best_of' must be 1", "best_of")
    max_tokens = _first_present(body, "max_tokens")
    # OpenAI's legacy scoring form: echo with max_tokens 0 gives the prompt's logprobs alone
    echo_only = echo and _is_int(body.get("max_tokens")) and body["max_tokens"] == 0
    sampling = _sampling(body, None if echo_only else max_tokens,
                         default_max_tokens=DEFAULT_COMPLETION_MAX_TOKENS)
    if echo_only and sampling.min_tokens:
        raise InvalidRequest("'min_tokens' asks for tokens that 'max_tokens' 0 (the prompt "
                             "alone) does not generate", "min_tokens")
    if top_logprobs is not None:
        sampling = replace(sampling, logprobs=True, top_logprobs=top_logprobs)
    return GenerateInput(model=model_field(body), prompts=prompts, **_stream(body), n=n,
                         sampling=sampling, constraint=_constraint(body), user=end_user(body),
                         cache_key=cache_key(body), echo=echo, echo_only=echo_only,
                         suffix=suffix or "")


def _prompts(prompt: Any) -> tuple[Prompt, ...]:
    """OpenAI's four forms: a string, an array of strings (a batch), an array of token ids,
    an array of arrays of token ids (a batch)."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and not any(
            isinstance(p, str | list) for p in prompt)):  # one prompt (its ids checked below)
        return (_prompt(prompt, "prompt"),)
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequest("'prompt' must be a non-empty string, an array of token ids, or "
                             "an array of either (a batch)", "prompt")
    return tuple(_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt))


def _prompt(prompt: Any, param: str) -> Prompt:
    if isinstance(prompt, str) and prompt:
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequest(f"'{param}' must be a non-empty string or a non-empty array of "
                             "token ids", param)
    for j, t in enumerate(prompt):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= MAX_TOKEN_ID:
            raise InvalidRequest(f"'{param}[{j}]' is {shown(t)}; token ids are integers from "
                                 f"0 to {MAX_TOKEN_ID}", f"{param}[{j}]")
    return tuple(prompt)


TOKENIZE_FIELDS = frozenset({"model", "prompt", "add_special_tokens", "messages", "tools",
                             "add_generation_prompt", "chat_template_kwargs"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})
MAX_DETOKENIZE_TOKENS = 1 << 20


@dataclass(frozen=True)
class TokenizeInput:
    model: str | None  # None: the first ready engine's
    prompt: str | None  # a completion prompt, or (None) a chat:
    messages: tuple[Message, ...] = ()  # through the chat template, the generation prompt added
    tools: Tools | None = None
    template_kwargs_json: str = ""


@dataclass(frozen=True)
class DetokenizeInput:
    model: str | None
    tokens: tuple[int, ...]


def parse_tokenize(body: Any) -> TokenizeInput:
    """vLLM's POST /tokenize: a prompt's ids as /v1/completions would take it (no special
    tokens added; `add_special_tokens` true is refused rather than ignored), or a chat's as
    /v1/chat/completions would (`messages` and `tools` through the chat template, which adds
    the generation prompt: `add_generation_prompt` false is refused)."""
    body = request_object(body)
    _refuse_unknown(body, TOKENIZE_FIELDS, "/tokenize", DETOKENIZE_FIELDS, "/detokenize")
    if bool_field(body, "add_special_tokens", False):
        raise InvalidRequest("Strata adds no special tokens to a prompt (a completion prompt "
                             "is tokenized as it is written); send add_special_tokens false, "
                             "or write the tokens into the text", "add_special_tokens")
    if body.get("messages") is None:
        for name in ("tools", "add_generation_prompt", "chat_template_kwargs"):
            if body.get(name) is not None:
                raise InvalidRequest(f"'{name}' belongs to a chat: send 'messages'", name)
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise InvalidRequest("'prompt' must be a string (or send 'messages')", "prompt")
        return TokenizeInput(_optional_model(body), prompt)
    if body.get("prompt") is not None:
        raise InvalidRequest("give 'prompt' or 'messages', not both", "prompt")
    generation = body.get("add_generation_prompt")
    if generation is not None and generation is not True:
        raise InvalidRequest("'add_generation_prompt' must be true: the chat template's "
                             "generation prompt is always added, as a chat request's prompt "
                             "has it", "add_generation_prompt")
    messages = body["messages"]
    if not isinstance(messages, list) or not 0 < len(messages) <= MAX_MESSAGES:
        raise InvalidRequest(f"'messages' must be an array of 1-{MAX_MESSAGES} messages",
                             "messages")
    return TokenizeInput(_optional_model(body), None,
                         tuple(_message(m, i) for i, m in enumerate(messages)),
                         parse_tools({"tools": body.get("tools")}),
                         template_kwargs(body.get("chat_template_kwargs")))


def parse_detokenize(body: Any) -> DetokenizeInput:
    """vLLM's POST /detokenize: token ids' text (special tokens kept)."""
    body = request_object(body)
    _refuse_unknown(body, DETOKENIZE_FIELDS, "/detokenize", TOKENIZE_FIELDS, "/tokenize")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or len(tokens) > MAX_DETOKENIZE_TOKENS:
        raise InvalidRequest(f"'tokens' must be an array of at most {MAX_DETOKENIZE_TOKENS} "
                             "token ids", "tokens")
    return DetokenizeInput(_optional_model(body),
                           _prompt(tokens, "tokens") if tokens else ())


def _optional_model(body: dict[str, Any]) -> str | None:
    return None if body.get("model") is None else model_field(body)


# -- pieces ------------------------------------------------------------------------------------


def request_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    _unicode(body)
    return body


def _unicode(body: dict[str, Any]) -> None:
    """Refuse a string anywhere in the body that is not valid Unicode: JSON lets a lone UTF-16
    surrogate ("\\ud800") through, which no tokenizer or response can encode."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
            keys = [k for k in value if isinstance(k, str)]
            stack.extend((f"{path} (a key)", k) for k in keys)
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InvalidRequest(f"'{path}' is not valid Unicode (a lone surrogate at "
                                     f"character {e.start})", path or None) from None


def model_field(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' must be a non-empty string (see GET /v1/models)", "model")
    return model


def _refuse_unknown(body: dict[str, Any], fields: frozenset[str], endpoint: str,
                    other_fields: frozenset[str], other: str) -> None:
    """A 400 naming the first field this endpoint does not read (the other endpoint's own
    fields get a pointer to it). A null asks for nothing, so it is no field to refuse: clients
    that send every OpenAI parameter, unset ones as null, work."""
    name = first_unknown(body, fields)
    if name is None:
        return
    if name in other_fields:
        why = f"'{name}' is a {other} field, not one of {endpoint}"
    else:
        why = (f"'{name}' is not a field of {endpoint}: Strata implements or refuses every "
               "field (GET /openapi.json lists them)")
    raise InvalidRequest(why, name, code="unsupported_parameter")


def end_user(body: dict[str, Any]) -> str | None:
    """The end user: `safety_identifier` (OpenAI's current name), else `user`."""
    for key in ("user", "safety_identifier"):
        value = body.get(key)
        if value is not None and (not isinstance(value, str) or len(value) > MAX_USER_CHARS):
            raise InvalidRequest(f"'{key}' must be a string of at most {MAX_USER_CHARS} "
                                 "characters", key)
    return body.get("safety_identifier") or body.get("user")


def cache_key(body: dict[str, Any]) -> str | None:
    """`prompt_cache_key`: the engine that keeps a conversation's prefix (admission.place)."""
    value = body.get("prompt_cache_key")
    if value is not None and (not isinstance(value, str) or not value
                              or len(value) > MAX_CACHE_KEY_CHARS):
        raise InvalidRequest(f"'prompt_cache_key' must be a non-empty string of at most "
                             f"{MAX_CACHE_KEY_CHARS} characters", "prompt_cache_key")
    return value


def _constraint(body: dict[str, Any]) -> Constraint | None:
    """The output constraint: OpenAI's response_format (json_object, json_schema), or one of
    vLLM's guided_* fields; at most one. Whether a schema or grammar compiles is the engine's
    to say (a 400 naming the problem)."""
    found: list[tuple[str, Constraint]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise InvalidRequest("'response_format' must be an object with a 'type'",
                                 "response_format")
        refuse_unknown_keys(fmt, RESPONSE_FORMAT_FIELDS if fmt["type"] == "json_schema"
                            else frozenset({"type"}), "response_format", "'response_format'")
        if fmt["type"] == "json_object":
            found.append(("response_format", Constraint("json_object")))
        elif fmt["type"] == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict):
                raise InvalidRequest("'response_format.json_schema' must be an object with a "
                                     "'name' and a 'schema'", "response_format.json_schema")
            found.append(("response_format", Constraint("json_schema", json_schema_text(
                spec, "response_format.json_schema", JSON_SCHEMA_FIELDS,
                default={"type": "object"}))))
        elif fmt["type"] != "text":
            raise InvalidRequest(f"response_format type {shown(fmt['type'])} is not one of 'text', "
                                 "'json_object', 'json_schema'", "response_format.type")
    for name in GUIDED_FIELDS:
        value = body.get(name)
        if value is not None:
            found.append((name, _guided(name, value)))
    if len(found) > 1:
        raise InvalidRequest(f"one output constraint at most: '{found[0][0]}' and "
                             f"'{found[1][0]}' were both given", found[1][0])
    if not found:
        return None
    name, constraint = found[0]
    if len(constraint.text) > MAX_GRAMMAR_CHARS:
        raise InvalidRequest(f"'{name}' is {len(constraint.text)} characters; at most "
                             f"{MAX_GRAMMAR_CHARS}", name)
    return constraint


def json_schema_text(spec: dict[str, Any], param: str, fields: frozenset[str],
                     default: dict[str, Any] | None = None) -> str:
    """A json_schema output format (`spec`, at `param`; it may hold `fields`) -> its schema as
    JSON text: `name` checked, `strict` true or false (the output is held to the schema
    either way, OpenAI's strict), `schema` an object (`default` where it is left out, else
    required), and `description` refused, since no chat template shows it to the model."""
    if spec.get("description") is not None:
        raise InvalidRequest(f"'{param}.description' is not shown to the model (no chat "
                             "template has a place for it); the schema alone holds the output: "
                             "say what the answer is for in a message",
                             f"{param}.description", code="unsupported_parameter")
    refuse_unknown_keys(spec, fields, param, f"'{param}'")
    name = spec.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise InvalidRequest(f"'{param}.name' must be 1-64 letters, digits, '_' or '-'",
                             f"{param}.name")
    bool_field(spec, "strict", True, f"{param}.")
    schema = spec.get("schema", default)
    if not isinstance(schema, dict):
        raise InvalidRequest(f"'{param}.schema' must be a JSON Schema object",
                             f"{param}.schema")
    return json.dumps(schema)


def _guided(name: str, value: Any) -> Constraint:
    if name == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise InvalidRequest("'guided_json' must be a JSON Schema (an object, or its "
                                     "JSON text)", name) from None
        if not isinstance(value, dict):
            raise InvalidRequest("'guided_json' must be a JSON Schema object", name)
        return Constraint("json_schema", json.dumps(value))
    if name == "guided_choice":
        if not isinstance(value, list) or not value or \
                not all(isinstance(v, str) and v for v in value):
            raise InvalidRequest("'guided_choice' must be a non-empty array of non-empty "
                                 "strings", name)
        return Constraint("lark", "start: " + " | ".join(json.dumps(v) for v in value))
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"'{name}' must be a non-empty string", name)
    return Constraint("regex" if name == "guided_regex" else "lark", value)


def _refuse_unsupported_chat(body: dict[str, Any]) -> None:
    for name in LEGACY_TOOL_FIELDS:
        if body.get(name) is not None:
            raise InvalidRequest(f"'{name}' is the deprecated form of "
                                 f"'{'tools' if name == 'functions' else 'tool_choice'}'; "
                                 "send that instead", name, code="unsupported_parameter")


def _message(raw: Any, index: int) -> Message:
    param = f"messages[{index}]"
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{param} must be an object with 'role' and 'content'", param)
    role = raw.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:
        raise InvalidRequest(f"{param}.role must be one of system, developer, user, assistant, "
                             f"tool; got {shown(role)}", f"{param}.role")
    refuse_unknown_keys(raw, MESSAGE_FIELDS, param, "a chat message")
    for key, wanted in (("tool_calls", "assistant"), ("refusal", "assistant"),
                        ("reasoning_content", "assistant"), ("tool_call_id", "tool")):
        if raw.get(key) is not None and role != wanted:
            raise InvalidRequest(f"{param}.{key}: only an {wanted} message has one",
                                 f"{param}.{key}")
    content = raw.get("content")
    if isinstance(content, list):
        content = "".join(_text_part(part, f"{param}.content[{i}]")
                          for i, part in enumerate(content))
    if content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise InvalidRequest(f"{param}.content must be a string or a list of text parts",
                             f"{param}.content")
    calls: tuple[ToolCall, ...] = ()
    if raw.get("tool_calls") is not None:
        calls = parse_history_calls(raw["tool_calls"], f"{param}.tool_calls")
    if (refusal := _optional_text(raw, "refusal", param)) is not None:
        if content:
            raise InvalidRequest(f"{param}: an assistant message has content or a refusal, not "
                                 "both", f"{param}.refusal")
        content = refusal  # what the assistant said
    reasoning = _optional_text(raw, "reasoning_content", param) or ""
    call_id = raw.get("tool_call_id")
    if role == "tool" and (not isinstance(call_id, str) or not call_id):
        raise InvalidRequest(f"{param}.tool_call_id: a tool message answers a call; give its "
                             "id", f"{param}.tool_call_id")
    name = raw.get("name")
    if name is not None and (not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS):
        raise InvalidRequest(f"{param}.name must be a string of 1 to {MAX_NAME_CHARS} "
                             "characters", f"{param}.name")
    return Message(CHAT_ROLES[role], content, calls, call_id or "", name or "", reasoning)


def _optional_text(raw: dict[str, Any], key: str, param: str) -> str | None:
    value = raw.get(key)
    if value is not None and not isinstance(value, str):
        raise InvalidRequest(f"{param}.{key} must be a string", f"{param}.{key}")
    return value


def _text_part(part: Any, param: str) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        refuse_unknown_keys(part, TEXT_PART_FIELDS, param, "a text part")
        return part["text"]
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise InvalidRequest(f"{param} must be {{'type': 'text', 'text': ...}}; parts of type "
                         f"{kind!r} are not supported", param)


def _stream(body: dict[str, Any]) -> dict[str, bool]:
    stream = bool_field(body, "stream", False)
    options = stream_options(body, stream, STREAM_OPTIONS)
    include_usage = bool_field(options, "include_usage", False, "stream_options.")
    return {"stream": stream, "include_usage": stream and include_usage}


def stream_options(body: dict[str, Any], stream: bool, fields: frozenset[str]
                   ) -> dict[str, Any]:
    """`stream_options`: only with `stream: true`, an object of these keys ({} when none)."""
    options = body.get("stream_options")
    if options is None:
        return {}
    if not stream:
        raise InvalidRequest("'stream_options' is only allowed with 'stream': true",
                             "stream_options")
    if not isinstance(options, dict):
        raise InvalidRequest("'stream_options' must be an object", "stream_options")
    refuse_unknown_keys(options, fields, "stream_options", "'stream_options'")
    return options


def bool_field(body: dict[str, Any], key: str, default: bool, prefix: str = "") -> bool:
    """`key` as true or false (`default` when null or left out); `prefix`: where `body` sits
    in the request, for the 400's name."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"'{prefix}{key}' must be true or false", prefix + key)
    return value


def _sampling(body: dict[str, Any], max_tokens_key: str | None,
              default_max_tokens: int) -> Sampling:
    max_tokens = default_max_tokens
    if max_tokens_key is not None:
        max_tokens = int_field(body, max_tokens_key, low=1, high=MAX_TOKENS_LIMIT)
    temperature = number_field(body, "temperature", 1.0, low=0.0, high=2.0)
    top_p = number_field(body, "top_p", 1.0, low=0.0, high=1.0)
    if top_p == 0.0:
        raise InvalidRequest("'top_p' must be in (0, 1]", "top_p")
    top_k = 0
    if body.get("top_k") is not None:
        top_k = int_field(body, "top_k", low=-1, high=MAX_TOP_K)
        top_k = max(top_k, 0)  # -1 (vLLM's "off") means the same as 0
    seed = None
    if body.get("seed") is not None:
        seed = int_field(body, "seed", low=0, high=2**64 - 1)
    repetition = number_field(body, "repetition_penalty", 1.0, low=0.0, high=MAX_REPETITION_PENALTY)
    if repetition == 0.0:
        raise InvalidRequest(f"'repetition_penalty' must be in (0, {MAX_REPETITION_PENALTY:g}]",
                             "repetition_penalty")
    min_tokens = 0
    if body.get("min_tokens") is not None:
        min_tokens = int_field(body, "min_tokens", low=0, high=MAX_TOKENS_LIMIT)
        if max_tokens and min_tokens > max_tokens:
            raise InvalidRequest(f"'min_tokens' ({min_tokens}) exceeds the maximum tokens "
                                 f"({max_tokens})", "min_tokens")
    ignore_eos = bool_field(body, "ignore_eos", False)
    return Sampling(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                    max_tokens=max_tokens, stop=_stop(body.get("stop")),
                    presence_penalty=number_field(body, "presence_penalty", 0.0, low=-2.0,
                                                  high=2.0),
                    frequency_penalty=number_field(body, "frequency_penalty", 0.0, low=-2.0,
                                                   high=2.0),
                    repetition_penalty=repetition, logit_bias=_logit_bias(body.get("logit_bias")),
                    min_p=number_field(body, "min_p", 0.0, low=0.0, high=1.0),
                    min_tokens=min_tokens, ignore_eos=ignore_eos,
                    stop_token_ids=_token_ids(body))


def _choices(body: dict[str, Any]) -> int:
    return 1 if body.get("n") is None else int_field(body, "n", low=1, high=MAX_CHOICES)


def _max_tokens_key(body: dict[str, Any]) -> str | None:
    """The chat limit's key: max_completion_tokens (OpenAI's current name) or max_tokens; both
    are validated, and given together they must agree."""
    given = [k for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None]
    values = {k: int_field(body, k, low=1, high=MAX_TOKENS_LIMIT) for k in given}
    if len(set(values.values())) > 1:
        raise InvalidRequest(f"'max_completion_tokens' ({values['max_completion_tokens']}) and "
                             f"'max_tokens' ({values['max_tokens']}) disagree; give one",
                             "max_tokens")
    return given[0] if given else None


def _logit_bias(raw: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} with biases in [-100, 100]."""
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise InvalidRequest("'logit_bias' must be an object of token id -> bias", "logit_bias")
    if len(raw) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"'logit_bias' takes at most {MAX_LOGIT_BIAS} entries",
                             "logit_bias")
    out = []
    for key, bias in raw.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise InvalidRequest(f"'logit_bias' keys are token ids (non-negative integers as "
                                 f"strings); got {shown(key)}", "logit_bias")
        if not _is_number(bias) or not -100 <= bias <= 100:
            raise InvalidRequest(f"'logit_bias' values must be numbers in [-100, 100]; got "
                                 f"{shown(bias)} for {shown(key)}", "logit_bias")
        if len(key) > 10 or int(key) >= 2**31:
            raise InvalidRequest(f"'logit_bias' token id {shown(key)} is out of range",
                                 "logit_bias")
        out.append((int(key), float(bias)))
    return tuple(sorted(out))


def _token_ids(body: dict[str, Any]) -> tuple[int, ...]:
    raw = body.get("stop_token_ids")
    if raw is None:
        return ()
    if (not isinstance(raw, list) or len(raw) > MAX_STOP_TOKEN_IDS
            or not all(_is_int(i) and 0 <= i < 2**31 for i in raw)):
        raise InvalidRequest(f"'stop_token_ids' must be a list of at most "
                             f"{MAX_STOP_TOKEN_IDS} token ids", "stop_token_ids")
    return tuple(raw)


def _stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise InvalidRequest("'stop' must be a non-empty string or a list of them", "stop")
    if len(stop) > MAX_STOP_SEQUENCES or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise InvalidRequest(f"'stop' takes at most {MAX_STOP_SEQUENCES} sequences of at most "
                             f"{MAX_STOP_CHARS} characters", "stop")
    return tuple(stop)


def _first_present(body: dict[str, Any], *keys: str) -> str | None:
    return next((k for k in keys if body.get(k) is not None), None)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """An int (any size: Python compares it with the bounds exactly) or a finite float."""
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


def shown(value: Any) -> str:
    """A value for an error message, short (an integer past Python's digit limit has no
    repr at all)."""
    if _is_int(value) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def int_field(body: dict[str, Any], key: str, *, low: int, high: int | None = None) -> int:
    value = body[key]
    if not _is_int(value):
        raise InvalidRequest(f"'{key}' must be an integer; got {shown(value)}", key)
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise InvalidRequest(f"'{key}' must be {bound}; got {shown(value)}", key)
    return value


def number_field(body: dict[str, Any], key: str, default: float, *, low: float,
                 high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if not _is_number(value):
        raise InvalidRequest(f"'{key}' must be a number; got {shown(value)}", key)
    if not low <= value <= high:
        raise InvalidRequest(f"'{key}' must be in [{low:g}, {high:g}]; got {shown(value)}", key)
    return float(value)
