"""The Responses API (`POST /v1/responses`) on top of the chat path Strata already serves: its
request becomes a chat request, and the answer goes back as Responses objects and stream events
(pure dicts; the aiohttp handler is in handlers.py, the records in response_store.py).

    instructions                         -> a system message, first (never carried over)
    input: a string, or items            -> chat messages:
        message (user, system, developer, assistant; text parts)
        reasoning                        -> the next assistant message's reasoning
        function_call                    -> a call of an assistant message
        function_call_output             -> a tool message
      after the stored conversation of previous_response_id
    tools (function tools), tool_choice, parallel_tool_calls, text.format -> the chat request's
    the answer                           -> output items: reasoning, a message of output_text,
                                            function calls

    reasoning.summary                    -> the same model summarizes each reasoning item in a
                                            second request (summary_request; handlers.py)

    conversation                         -> its items before the input (after
                                            previous_response_id's place); the answered turn
                                            joins them (conversations.py)
    background                           -> answered at once, queued; the gateway runs it on
                                            and stores it (handlers._detach); POST .../cancel;
                                            with stream, an event log GET reads and resumes

Any field Strata does not read is refused by name, as on the other endpoints: tool types other
than functions, non-text content.
"""

from __future__ import annotations

import base64
import re
import time
import uuid
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from services.gateway.admission import estimate_prompt_tokens
from services.gateway.errors import InvalidRequest, first_unknown, refuse_unknown_keys
from services.gateway.responses import Figures, logprob_entry
from services.gateway.schemas import (
    MAX_GRAMMAR_CHARS,
    MAX_MESSAGES,
    MAX_TOKENS_LIMIT,
    MAX_TOP_LOGPROBS,
    Constraint,
    GenerateInput,
    Message,
    Sampling,
    bool_field,
    cache_key,
    end_user,
    int_field,
    json_schema_text,
    model_field,
    number_field,
    reasoning_effort,
    request_object,
    shown,
    stream_options,
)
from services.gateway.tools import FUNCTION_NAME, ToolCall, Tools, parse_tools

RESPONSES_FIELDS = frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream",
    "store", "metadata", "previous_response_id", "text", "tools", "tool_choice",
    "parallel_tool_calls", "top_logprobs", "include", "user", "safety_identifier", "truncation",
    "background", "reasoning", "stream_options", "prompt_cache_key", "conversation"})
# POST /v1/responses/input_tokens: what shapes the prompt (text.format adds no tokens here: the
# grammar holds the output, nothing is written into the prompt)
INPUT_TOKENS_FIELDS = frozenset({
    "model", "input", "instructions", "previous_response_id", "tools", "tool_choice",
    "parallel_tool_calls", "text", "truncation", "reasoning", "conversation"})
LOGPROBS_INCLUDE = "message.output_text.logprobs"
REASONING_INCLUDE = "reasoning.encrypted_content"
INCLUDES = (LOGPROBS_INCLUDE, REASONING_INCLUDE)
# A reasoning item's encrypted_content: its text, compressed and encoded, for clients that keep
# no state (store false) and send it back. Not encrypted: the same text is in the item's
# content, since an open model's reasoning is the caller's to read.
REASONING_TOKEN_PREFIX = "strata.r1."
# reasoning.summary: the model summarizes its own reasoning in a second, greedy request
# (summary_request); "auto" asks for the most detailed summary there is, as OpenAI's does.
SUMMARIES = ("auto", "concise", "detailed")
SUMMARY_INSTRUCTIONS = {
    "concise": "Summarize the reasoning you are given in one or two sentences for the person "
               "who asked: what it concluded, not how. Add nothing it does not say.",
    "detailed": "Summarize the reasoning you are given in a short paragraph for the person "
                "who asked: the steps it took and what it concluded. Add nothing it does not "
                "say.",
}
SUMMARY_MAX_TOKENS = {"concise": 256, "detailed": 1024}
MAX_REASONING_CHARS = 1 << 22
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")
CONVERSATION_ID = re.compile(r"conv_[0-9a-f]{32}")
# The keys read at each level of an input item (openapi.py's ResponsesInputItem lists them).
MESSAGE_ITEM_FIELDS = frozenset({"type", "role", "content", "id", "status"})
FUNCTION_CALL_FIELDS = frozenset({"type", "call_id", "name", "arguments", "id", "status"})
FUNCTION_OUTPUT_FIELDS = frozenset({"type", "call_id", "output", "id", "status"})
REASONING_FIELDS = frozenset({"type", "id", "summary", "content", "status",
                              "encrypted_content"})
TEXT_PART_FIELDS = frozenset({"type", "text"})
OUTPUT_TEXT_FIELDS = frozenset({"type", "text", "annotations", "logprobs"})
REFUSAL_PART_FIELDS = frozenset({"type", "refusal"})
TOOL_FIELDS = frozenset({"type", "name", "description", "parameters", "strict"})
TEXT_FIELDS = frozenset({"format"})
REASONING_CONFIG_FIELDS = frozenset({"effort", "summary"})
FORMAT_FIELDS = frozenset({"type", "name", "schema", "strict"})
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
NOT_TEXT = ("input_image", "input_file", "input_audio")


@dataclass(frozen=True)
class ResponsesInput(GenerateInput):
    """A Responses request: the chat request it becomes, and what its answer restates."""

    response_id: str = ""
    created_at: int = 0  # when the request was read (a background one's records keep it)
    input_items: tuple[dict[str, Any], ...] = ()  # this request's, normalized, each with an id
    context: tuple[dict[str, Any], ...] = ()  # the conversation before it (previous_response_id)
    ancestors: tuple[str, ...] = ()  # the stored responses that conversation is, oldest first
    instructions: str | None = None
    previous_response_id: str | None = None
    conversation_id: str | None = None  # its items before the input; the answer appended
    store: bool = True
    background: bool = False  # answered at once (queued), run on; read back with GET
    metadata: dict[str, str] = field(default_factory=dict)
    max_output_tokens: int | None = None
    tools_given: tuple[dict[str, Any], ...] = ()  # as the request gave them
    tool_choice_given: Any = "auto"
    text_format: dict[str, Any] = field(default_factory=lambda: {"type": "text"})
    include_logprobs: bool = False
    include_reasoning: bool = False  # a reasoning item's encrypted_content
    reasoning_summary: str = ""  # "auto", "concise", "detailed": a summary of each reasoning
    truncation: str = "disabled"  # "auto": the conversation's oldest turns may be left out
    dropped: int = 0  # items of the conversation left out of the prompt (truncation "auto")

    @property
    def conversation(self) -> tuple[dict[str, Any], ...]:
        return (*self.context, *self.input_items)

    @property
    def context_field(self) -> str:
        """The field that brought the conversation before the input."""
        return "conversation" if self.conversation_id is not None else "previous_response_id"

    @property
    def prompt_estimate(self) -> int:
        """A continued conversation's prompt is mostly in the store, not the body: its
        messages' text, counted as admission counts a body."""
        if not self.context:
            return 0
        return estimate_prompt_tokens(sum(
            len(m.content) + len(m.reasoning_content)
            + sum(len(c.name) + len(c.arguments) for c in m.tool_calls) for m in self.messages))

    @property
    def placement_key(self) -> str | None:
        """prompt_cache_key, else the conversation (its id, or its first stored response): a
        conversation's turns go to one engine, where its prefix is (an unstored lone turn: any
        engine)."""
        if self.cache_key is not None:
            return self.cache_key
        if self.conversation_id is not None:
            return self.conversation_id
        if self.ancestors:
            return self.ancestors[0]
        return self.response_id if self.store else None

    def with_context(self, context: Sequence[dict[str, Any]], dropped: int = 0
                     ) -> ResponsesInput:
        """The request with the stored conversation it continues, as chat messages, less its
        first `dropped` items."""
        messages = items_to_messages([*context, *self.input_items][dropped:])
        if self.instructions:
            messages = [Message("system", self.instructions), *messages]
        if len(messages) > MAX_MESSAGES and self.truncation != "auto":  # auto: _fit cuts
            raise InvalidRequest(f"the conversation has {len(messages)} messages; at most "
                                 f"{MAX_MESSAGES}: start a new one, or send truncation "
                                 "'auto'", self.context_field if context else "input")
        return replace(self, context=tuple(context), messages=tuple(messages), dropped=dropped)

    def turn_starts(self) -> list[int]:
        """Where the conversation may be cut (truncation "auto"): before each user message
        but the first, so that what is left starts with a user's turn and no tool output
        loses the call it answers."""
        return [i for i, item in enumerate(self.conversation)
                if i > 0 and item["type"] == "message" and item["role"] == "user"]


def parse_responses(body: Any, fields: frozenset[str] = RESPONSES_FIELDS,
                    endpoint: str = "/v1/responses") -> ResponsesInput:
    """The request, validated; its messages still lack the conversation of
    previous_response_id (`with_context`). `fields`: the ones the endpoint reads."""
    body = request_object(body)
    if (name := first_unknown(body, fields)) is not None:
        raise InvalidRequest(f"'{name}' is not supported by Strata's {endpoint}; it reads "
                             f"{', '.join(sorted(fields))}", name, code="unsupported_parameter")
    truncation = body.get("truncation") or "disabled"
    if truncation not in ("disabled", "auto"):
        raise InvalidRequest("'truncation' must be 'disabled' (a conversation past the context "
                             "window is a 400) or 'auto' (its oldest turns are left out)",
                             "truncation")
    stream = bool_field(body, "stream", False)
    _stream_options(body, stream)
    store = bool_field(body, "store", True)
    background = bool_field(body, "background", False)
    if background and not store:
        raise InvalidRequest("'background' responses are stored (they are read back with GET "
                             "/v1/responses/{id}); send 'store': true or leave it out",
                             "background")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequest("'instructions' must be a string", "instructions")
    previous = body.get("previous_response_id")
    if previous is not None and not (isinstance(previous, str)
                                     and RESPONSE_ID.fullmatch(previous)):
        raise InvalidRequest(f"'previous_response_id' must be a response id (resp_ and 32 hex "
                             f"digits); got {shown(previous)}", "previous_response_id")
    conversation_id = _conversation(body.get("conversation"))
    if conversation_id is not None and previous is not None:
        raise InvalidRequest("'conversation' and 'previous_response_id' both say what came "
                             "before; give one", "conversation")
    max_output = None
    if body.get("max_output_tokens") is not None:
        max_output = int_field(body, "max_output_tokens", low=1, high=MAX_TOKENS_LIMIT)
    include = _include(body.get("include"))
    logprobs = LOGPROBS_INCLUDE in include
    top_logprobs = 0
    if body.get("top_logprobs") is not None:
        top_logprobs = int_field(body, "top_logprobs", low=0, high=MAX_TOP_LOGPROBS)
        if top_logprobs and not logprobs:
            raise InvalidRequest(f"'top_logprobs' needs 'include': ['{LOGPROBS_INCLUDE}'], which "
                                 "asks for the logprobs they belong to", "top_logprobs")
    top_p = number_field(body, "top_p", 1.0, low=0.0, high=1.0)
    if top_p == 0.0:
        raise InvalidRequest("'top_p' must be in (0, 1]", "top_p")
    sampling = Sampling(temperature=number_field(body, "temperature", 1.0, low=0.0, high=2.0),
                        top_p=top_p, max_tokens=max_output or 0, logprobs=logprobs,
                        top_logprobs=top_logprobs)
    tools_given, tools = _tools(body)
    effort, summary = _reasoning(body.get("reasoning"))
    text_format, constraint = _text(body.get("text"))
    if constraint is not None and tools is not None and tools.choice != "auto":
        raise InvalidRequest("'tool_choice' that requires a call and 'text.format' both decide "
                             "the output's form; give one", "tool_choice")
    return ResponsesInput(
        reasoning_effort=effort, reasoning_summary=summary,
        model=model_field(body), sampling=sampling, stream=stream, constraint=constraint,
        tools=tools, user=end_user(body), cache_key=cache_key(body),
        response_id="resp_" + uuid.uuid4().hex, created_at=int(time.time()),
        input_items=input_items(body.get("input")),
        instructions=instructions, previous_response_id=previous, store=store,
        background=background, conversation_id=conversation_id,
        metadata=metadata_field(body), max_output_tokens=max_output,
        tools_given=tools_given, tool_choice_given=body.get("tool_choice") or "auto",
        text_format=text_format, include_logprobs=logprobs,
        include_reasoning=REASONING_INCLUDE in include, truncation=truncation)


# -- request pieces ----------------------------------------------------------------------------


def _stream_options(body: dict[str, Any], stream: bool) -> None:
    """`include_obfuscation`: Strata pads no deltas (false asks for what it does; true is
    refused)."""
    if bool_field(stream_options(body, stream, frozenset({"include_obfuscation"})),
                  "include_obfuscation", False, "stream_options."):
        raise InvalidRequest("'stream_options.include_obfuscation': Strata pads no stream "
                             "events (a server on your own network has no side channel to "
                             "hide); send false", "stream_options.include_obfuscation",
                             code="unsupported_parameter")


def _conversation(raw: Any) -> str | None:
    """`conversation`: its id, or an object with it."""
    if raw is None:
        return None
    if isinstance(raw, dict):
        refuse_unknown_keys(raw, frozenset({"id"}), "conversation", "'conversation'")
        raw = raw.get("id")
    if not (isinstance(raw, str) and CONVERSATION_ID.fullmatch(raw)):
        raise InvalidRequest(f"'conversation' must be a conversation id (conv_ and 32 hex "
                             f"digits) or {{'id': ...}}; got {shown(raw)}", "conversation")
    return raw


def _reasoning(raw: Any) -> tuple[str, str]:
    """`reasoning.effort` as the chat path's reasoning_effort, and `reasoning.summary` ("" for
    either not given)."""
    if raw is None:
        return "", ""
    if not isinstance(raw, dict):
        raise InvalidRequest("'reasoning' must be an object with an 'effort'", "reasoning")
    refuse_unknown_keys(raw, REASONING_CONFIG_FIELDS, "reasoning", "'reasoning'")
    summary = raw.get("summary")
    if summary is not None and summary not in SUMMARIES:
        raise InvalidRequest(f"'reasoning.summary' must be one of {', '.join(SUMMARIES)}; got "
                             f"{shown(summary)}", "reasoning.summary")
    return reasoning_effort(raw.get("effort"), "reasoning.effort"), summary or ""


def engine_param(param: str) -> str:
    """A field the engine named in its chat terms, as this request wrote it."""
    if param == "reasoning_effort":
        return "reasoning.effort"
    return "input" if param.startswith("messages") else param


def _include(raw: Any) -> frozenset[str]:
    """What the answer includes beyond the default: the output text's logprobs, reasoning
    items' encrypted_content."""
    if raw is None:
        return frozenset()
    if not isinstance(raw, list):
        raise InvalidRequest("'include' must be an array", "include")
    for i, value in enumerate(raw):
        if value not in INCLUDES:
            raise InvalidRequest(f"'include[{i}]' is {shown(value)}; Strata can include "
                                 f"{' and '.join(repr(v) for v in INCLUDES)}", f"include[{i}]",
                                 code="unsupported_parameter")
    return frozenset(raw)


def reasoning_token(text: str) -> str:
    """A reasoning item's encrypted_content (REASONING_TOKEN_PREFIX): its text, compressed."""
    return REASONING_TOKEN_PREFIX + base64.urlsafe_b64encode(
        zlib.compress(text.encode(), 6)).decode()


def decoded_reasoning(token: Any, param: str) -> str:
    """The text of a reasoning token this server wrote (a 400 naming `param` for any other)."""
    why = "is not reasoning this server encoded (include 'reasoning.encrypted_content')"
    if not isinstance(token, str) or not token.startswith(REASONING_TOKEN_PREFIX):
        raise InvalidRequest(f"{param} {why}", param)
    try:
        packed = base64.urlsafe_b64decode(token[len(REASONING_TOKEN_PREFIX):])
        inflate = zlib.decompressobj()
        text = inflate.decompress(packed, MAX_REASONING_CHARS * 4)
        if inflate.unconsumed_tail or not inflate.eof:
            raise ValueError("longer than a reasoning may be, or cut short")
        return text.decode()
    except (ValueError, zlib.error) as exc:  # binascii.Error and UnicodeError are ValueErrors
        raise InvalidRequest(f"{param} {why}: {exc}", param) from None


def metadata_field(body: dict[str, Any]) -> dict[str, str]:
    """`metadata`: at most MAX_METADATA_KEYS string pairs (a response's, a conversation's)."""
    raw = body.get("metadata")
    if raw is None:
        return {}
    if not isinstance(raw, dict) or len(raw) > MAX_METADATA_KEYS:
        raise InvalidRequest(f"'metadata' must be an object of at most {MAX_METADATA_KEYS} "
                             "keys", "metadata")
    for key, value in raw.items():
        if len(key) > MAX_METADATA_KEY_CHARS or not isinstance(value, str) \
                or len(value) > MAX_METADATA_VALUE_CHARS:
            raise InvalidRequest(f"'metadata' maps keys of at most {MAX_METADATA_KEY_CHARS} "
                                 f"characters to strings of at most {MAX_METADATA_VALUE_CHARS}; "
                                 f"{shown(key)} does not", f"metadata.{key}")
    return dict(raw)


def _tools(body: dict[str, Any]) -> tuple[tuple[dict[str, Any], ...], Tools | None]:
    """Function tools as the Responses API writes them (flat), checked here and handed to
    the chat path's parse_tools in its shape."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    chat: dict[str, Any] = {"parallel_tool_calls": body.get("parallel_tool_calls")}
    given: tuple[dict[str, Any], ...] = ()
    if raw:  # an empty list offers no tools
        if not isinstance(raw, list):
            raise InvalidRequest("'tools' must be an array of tools", "tools")
        given = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(raw))
        chat["tools"] = [{"type": "function", "function": {k: v for k, v in t.items()
                                                           if k != "type"}} for t in given]
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        choice = _allowed_tools(choice, {t["name"] for t in given})
    elif isinstance(choice, dict):
        if choice.get("type") != "function":
            raise InvalidRequest(f"'tool_choice' of type {shown(choice.get('type'))} is not "
                                 "supported: Strata's tools are functions", "tool_choice.type",
                                 code="unsupported_parameter")
        refuse_unknown_keys(choice, frozenset({"type", "name"}), "tool_choice", "'tool_choice'")
        name = choice.get("name")
        if name not in {t["name"] for t in given}:
            raise InvalidRequest(f"'tool_choice' names {shown(name)}, which is not in 'tools'",
                                 "tool_choice.name")
        choice = {"type": "function", "function": {"name": name}}
    elif choice is not None and choice not in ("none", "auto", "required"):
        raise InvalidRequest("'tool_choice' must be 'none', 'auto', 'required', "
                             "{'type': 'function', 'name': ...} or {'type': 'allowed_tools', "
                             "'mode': ..., 'tools': [...]}", "tool_choice")
    chat["tool_choice"] = choice
    return given, parse_tools(chat)


def _allowed_tools(choice: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """{'type': 'allowed_tools', 'mode', 'tools': [{'type': 'function', 'name'}, ...]},
    checked in this API's shape and handed on in the chat path's."""
    refuse_unknown_keys(choice, frozenset({"type", "mode", "tools"}), "tool_choice",
                        "'tool_choice'")
    if choice.get("mode") not in ("auto", "required"):
        raise InvalidRequest("'tool_choice.mode' must be 'auto' or 'required'",
                             "tool_choice.mode")
    listed = choice.get("tools")
    if not isinstance(listed, list) or not listed:
        raise InvalidRequest("'tool_choice.tools' must list at least one function the answer "
                             "may call", "tool_choice.tools")
    for i, tool in enumerate(listed):
        param = f"tool_choice.tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidRequest(f"'{param}' must be {{'type': 'function', 'name': ...}}", param)
        refuse_unknown_keys(tool, frozenset({"type", "name"}), param, f"'{param}'")
        if tool.get("name") not in names:
            raise InvalidRequest(f"'{param}' names {shown(tool.get('name'))}, which is not in "
                                 "'tools'", f"{param}.name")
    return {"type": "allowed_tools", "allowed_tools": {"mode": choice["mode"], "tools": [
        {"type": "function", "function": {"name": t["name"]}} for t in listed]}}


def _tool(raw: Any, param: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{param} must be {{'type': 'function', 'name': ..., "
                             "'parameters': {...}}", param)
    if raw.get("type") != "function":
        raise InvalidRequest(f"{param}.type {shown(raw.get('type'))} is not supported: Strata "
                             "runs no hosted tools; declare functions (type 'function') and "
                             "run them yourself", f"{param}.type", code="unsupported_parameter")
    refuse_unknown_keys(raw, TOOL_FIELDS, param, "a function tool")
    name = raw.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise InvalidRequest(f"{param}.name must be 1-64 letters, digits, '_' or '-'",
                             f"{param}.name")
    for key, kind, ok in (("description", "a string", isinstance(raw.get("description"), str)),
                          ("parameters", "a JSON Schema object",
                           isinstance(raw.get("parameters"), dict)),
                          ("strict", "true or false", isinstance(raw.get("strict"), bool))):
        if raw.get(key) is not None and not ok:
            raise InvalidRequest(f"{param}.{key} must be {kind}", f"{param}.{key}")
    # the Responses API's functions are strict unless they say otherwise: their calls are
    # held to the parameters by the grammar
    return {**{k: v for k, v in raw.items() if v is not None},
            "strict": raw.get("strict") is not False}


def _text(raw: Any) -> tuple[dict[str, Any], Constraint | None]:
    """`text.format` -> the constraint the chat path's response_format would give."""
    if raw is None:
        return {"type": "text"}, None
    if not isinstance(raw, dict):
        raise InvalidRequest("'text' must be an object with a 'format'", "text")
    refuse_unknown_keys(raw, TEXT_FIELDS, "text", "'text'")
    fmt = raw.get("format")
    if fmt is None:
        return {"type": "text"}, None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidRequest("'text.format' must be {'type': 'text'}, {'type': 'json_object'} "
                             "or {'type': 'json_schema', 'name': ..., 'schema': {...}}",
                             "text.format")
    if fmt["type"] == "json_schema":  # the chat path's check, its keys beside the type here
        text = json_schema_text(fmt, "text.format", FORMAT_FIELDS)
    else:
        refuse_unknown_keys(fmt, frozenset({"type"}), "text.format", "'text.format'")
        return dict(fmt), None if fmt["type"] == "text" else Constraint("json_object")
    if len(text) > MAX_GRAMMAR_CHARS:
        raise InvalidRequest(f"'text.format.schema' is {len(text)} characters; at most "
                             f"{MAX_GRAMMAR_CHARS}", "text.format.schema")
    return dict(fmt), Constraint("json_schema", text)


def input_items(raw: Any, name: str = "input",
                limit: int = MAX_MESSAGES) -> tuple[dict[str, Any], ...]:
    """Input items (`name`: the field they came in: input, or a conversation's items), each
    normalized (a message's type written out) with an id."""
    if isinstance(raw, str) and name == "input":
        return ({"id": _id("msg"), "type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": raw}]},)
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest(f"'{name}' must be " + ("a string or " if name == "input" else "")
                             + "a non-empty array of input items", name)
    if len(raw) > limit:
        raise InvalidRequest(f"at most {limit} items in '{name}'", name)
    items = []
    for i, item in enumerate(raw):
        param = f"{name}[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"{param} must be an input item (an object)", param)
        kind = item.get("type", "message")
        check = _ITEMS.get(kind)
        if check is None:
            raise InvalidRequest(f"{param}.type {shown(kind)} is not supported: Strata reads "
                                 f"items of type {', '.join(sorted(_ITEMS))}", f"{param}.type",
                                 code="unsupported_parameter")
        items.append(check(item, param))
    return tuple(items)


def _message_item(item: dict[str, Any], param: str) -> dict[str, Any]:
    refuse_unknown_keys(item, MESSAGE_ITEM_FIELDS, param, "a message item")
    role = item.get("role")
    if role not in ROLES:
        raise InvalidRequest(f"{param}.role must be one of user, system, developer, assistant; "
                             f"got {shown(role)}", f"{param}.role")
    content = item.get("content")
    if isinstance(content, str):
        content = [{"type": "output_text" if role == "assistant" else "input_text",
                    "text": content}]
    if not isinstance(content, list):
        raise InvalidRequest(f"{param}.content must be a string or an array of content parts",
                             f"{param}.content")
    for j, part in enumerate(content):
        _part(part, role, f"{param}.content[{j}]")
    return {**item, "type": "message", "content": content, "id": _item_id(item, param, "msg")}


def _part(part: Any, role: str, param: str) -> None:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in NOT_TEXT:
        raise InvalidRequest(f"{param} is of type {kind!r}; Strata serves text models: send "
                             "text parts", f"{param}.type", code="unsupported_parameter")
    fields = {"input_text": TEXT_PART_FIELDS, "output_text": OUTPUT_TEXT_FIELDS,
              "refusal": REFUSAL_PART_FIELDS}.get(kind or "")
    text_key = "refusal" if kind == "refusal" else "text"
    if fields is None or not isinstance(part.get(text_key), str):
        raise InvalidRequest(f"{param} must be a text part: {{'type': 'input_text', 'text': ...}}"
                             + (", or output_text / refusal for an assistant"
                                if role == "assistant" else ""), param)
    if kind != "input_text" and role != "assistant":
        raise InvalidRequest(f"{param}: a part of type {kind!r} is an assistant's; a {role} "
                             "message has input_text parts", f"{param}.type")
    refuse_unknown_keys(part, fields, param, f"an {kind} part")


def _function_call_item(item: dict[str, Any], param: str) -> dict[str, Any]:
    refuse_unknown_keys(item, FUNCTION_CALL_FIELDS, param, "a function_call item")
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str) or (key != "arguments" and not item[key]):
            raise InvalidRequest(f"{param}.{key} must be a string", f"{param}.{key}")
    return {**item, "id": _item_id(item, param, "fc")}


def _function_output_item(item: dict[str, Any], param: str) -> dict[str, Any]:
    refuse_unknown_keys(item, FUNCTION_OUTPUT_FIELDS, param, "a function_call_output item")
    if not isinstance(item.get("call_id"), str) or not item["call_id"]:
        raise InvalidRequest(f"{param}.call_id must name the call it answers", f"{param}.call_id")
    output = item.get("output")
    if isinstance(output, list):
        for j, part in enumerate(output):
            _part(part, "tool", f"{param}.output[{j}]")
    elif not isinstance(output, str):
        raise InvalidRequest(f"{param}.output must be a string or an array of input_text parts",
                             f"{param}.output")
    return {**item, "id": _item_id(item, param, "fco")}


def _reasoning_item(item: dict[str, Any], param: str) -> dict[str, Any]:
    refuse_unknown_keys(item, REASONING_FIELDS, param, "a reasoning item")
    for key, kind in (("summary", "summary_text"), ("content", "reasoning_text")):
        parts = item.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list) or not all(
                isinstance(p, dict) and p.get("type") == kind and isinstance(p.get("text"), str)
                and not first_unknown(p, TEXT_PART_FIELDS) for p in parts):
            raise InvalidRequest(f"{param}.{key} must be an array of {{'type': '{kind}', "
                                 "'text': ...}}", f"{param}.{key}")
    if item.get("encrypted_content") is not None:
        text = decoded_reasoning(item["encrypted_content"], f"{param}.encrypted_content")
        if not item.get("content"):  # a client that kept the token alone
            item = {**item, "content": [{"type": "reasoning_text", "text": text}]}
    return {**item, "id": _item_id(item, param, "rs")}


_ITEMS = {"message": _message_item, "function_call": _function_call_item,
          "function_call_output": _function_output_item, "reasoning": _reasoning_item}


def _item_id(item: dict[str, Any], param: str, prefix: str) -> str:
    given = item.get("id")
    if given is None:
        return _id(prefix)
    if not isinstance(given, str) or not given:
        raise InvalidRequest(f"{param}.id must be a string", f"{param}.id")
    return given


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_of(parts: list[dict[str, Any]]) -> str:
    return "".join(p.get("refusal", p.get("text", "")) for p in parts)


def items_to_messages(items: Sequence[dict[str, Any]]) -> list[Message]:
    """Normalized items -> chat messages. A function call joins the assistant message right
    before it (or starts one); a reasoning item goes with the assistant message after it."""
    messages: list[Message] = []
    reasoning = ""
    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            reasoning += _text_of(item.get("content") or item.get("summary") or [])
        elif kind == "message":
            role = ROLES[item["role"]]
            if role != "assistant" and reasoning:
                reasoning = ""  # a thought the model had before a turn it did not take
            messages.append(Message(role, _text_of(item["content"]),
                                    reasoning_content=reasoning if role == "assistant" else ""))
            reasoning = ""
        elif kind == "function_call":
            call = ToolCall(item["call_id"], item["name"], item["arguments"])
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and not reasoning:
                messages[-1] = replace(last, tool_calls=(*last.tool_calls, call))
            else:
                messages.append(Message("assistant", "", (call,), reasoning_content=reasoning))
            reasoning = ""
        else:  # function_call_output
            output = item["output"]
            messages.append(Message("tool", output if isinstance(output, str)
                                    else _text_of(output), tool_call_id=item["call_id"]))
    if not messages:
        raise InvalidRequest("the input has no message to answer (reasoning items alone)",
                             "input")
    return messages


# -- the answer --------------------------------------------------------------------------------


def summary_request(spec: ResponsesInput, reasoning: str, channeled: bool) -> GenerateInput:
    """The engine request that summarizes `reasoning` (reasoning.summary): the same model,
    greedy, within SUMMARY_MAX_TOKENS; a channeled (harmony) model at its lowest reasoning
    effort, its own reasoning about the summary left out (the caller keeps its final text)."""
    kind = "concise" if spec.reasoning_summary == "concise" else "detailed"
    return GenerateInput(
        model=spec.model, sampling=Sampling(temperature=0.0, max_tokens=SUMMARY_MAX_TOKENS[kind]),
        messages=(Message("system", SUMMARY_INSTRUCTIONS[kind]),
                  Message("user", f"The reasoning to summarize:\n\n{reasoning}")),
        reasoning_effort="low" if channeled else "")


def response_usage(input_tokens: int, output_tokens: int, cached_tokens: int,
                   reasoning_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


class ResponseBuilder:
    """One response, built as the answer streams: `response` is the object so far, and for a
    streaming request each change queues the numbered stream events that tell it
    (`take_events`). A non-streaming request makes the same calls and queues nothing.

    Output items open and close in order: a reasoning item, a message of output_text, function
    calls (each whole: their arguments arrive once the call has closed)."""

    def __init__(self, spec: ResponsesInput) -> None:
        self.spec = spec
        self.output: list[dict[str, Any]] = []
        self.status = "in_progress"
        self.usage: dict[str, Any] | None = None
        self.incomplete_reason: str | None = None
        self.error: dict[str, Any] | None = None
        self.figures: Figures | None = None
        self._open: dict[str, Any] | None = None  # the item text is going into
        self._pieces: list[str] = []  # its text so far, joined when it closes
        self._events: list[dict[str, Any]] | None = [] if spec.stream else None
        self._sequence = 0
        self._summarized: str | None = None  # the reasoning item whose summary is written
        self._summary: list[str] = []  # its text so far
        self.summary_tokens = 0  # the summaries' completion tokens

    @property
    def response(self) -> dict[str, Any]:
        spec = self.spec
        body: dict[str, Any] = {
            "id": spec.response_id, "object": "response", "created_at": spec.created_at,
            "status": self.status, "background": spec.background,
            "error": self.error, "incomplete_details": (
                {"reason": self.incomplete_reason} if self.incomplete_reason else None),
            "instructions": spec.instructions, "max_output_tokens": spec.max_output_tokens,
            "metadata": spec.metadata, "model": spec.model, "output": self.output,
            "parallel_tool_calls": spec.tools.parallel if spec.tools else True,
            "previous_response_id": spec.previous_response_id,
            "conversation": ({"id": spec.conversation_id} if spec.conversation_id else None),
            "prompt_cache_key": spec.cache_key,
            "reasoning": {"effort": spec.reasoning_effort or None,
                          "summary": spec.reasoning_summary or None},
            "store": spec.store, "temperature": spec.sampling.temperature,
            "text": {"format": spec.text_format}, "tool_choice": spec.tool_choice_given,
            "tools": list(spec.tools_given), "top_logprobs": spec.sampling.top_logprobs,
            "top_p": spec.sampling.top_p, "truncation": spec.truncation, "usage": self.usage,
            "user": spec.user}
        if self.figures is not None:
            body["strata"] = self.figures.as_dict()
        return body

    @property
    def reasoning_text(self) -> str:
        return "".join("".join(self._pieces) if item is self._open else item["content"][0]["text"]
                       for item in self.output if item["type"] == "reasoning")

    def take_events(self) -> list[dict[str, Any]]:
        """The events queued since the last call (none for a non-streaming request)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def queue(self) -> None:
        """A background response, answered before it runs: created, queued."""
        self.status = "queued"
        self._event("response.created", response=self.response)
        self._event("response.queued", response=self.response)

    def start(self) -> None:
        first = self.status != "queued"
        self.status = "in_progress"
        if first:
            self._event("response.created", response=self.response)
        self._event("response.in_progress", response=self.response)


    def reasoning(self, text: str) -> None:
        if text:
            self._open_item("reasoning", {"summary": []}, "reasoning_text")
            self._delta("response.reasoning_text.delta", text)

    @property
    def needs_summary(self) -> str:
        """The open reasoning item's text, where reasoning.summary asks for its summary and it
        has none yet: summarize it (summary_start ... summary_done) before anything closes the
        item. "" otherwise."""
        item = self._open
        if not self.spec.reasoning_summary or item is None or item["type"] != "reasoning" \
                or item["id"] == self._summarized:
            return ""
        return "".join(self._pieces)

    def summary_start(self) -> None:
        item = self._open
        assert item is not None and item["type"] == "reasoning"
        self._summarized, self._summary = item["id"], []
        self._event("response.reasoning_summary_part.added", item_id=item["id"],
                    output_index=len(self.output) - 1, summary_index=0,
                    part={"type": "summary_text", "text": ""})

    def summary_delta(self, text: str) -> None:
        if text:
            self._summary.append(text)
            self._event("response.reasoning_summary_text.delta", item_id=self._summarized,
                        output_index=len(self.output) - 1, summary_index=0, delta=text)

    @property
    def summary_text(self) -> str:
        return "".join(self._summary)

    def summary_done(self, tokens: int) -> None:
        """The summary is whole; `tokens`: its completion tokens (counted in output_tokens)."""
        self.summary_tokens += tokens
        item = self._open
        assert item is not None and item["id"] == self._summarized
        part = {"type": "summary_text", "text": self.summary_text}
        item["summary"] = [part]
        fields = {"item_id": item["id"], "output_index": len(self.output) - 1,
                  "summary_index": 0}
        self._event("response.reasoning_summary_text.done", text=part["text"], **fields)
        self._event("response.reasoning_summary_part.done", part=part, **fields)

    def text(self, text: str, logprobs: Sequence[Any] = ()) -> None:
        if not text and not logprobs:
            return
        self._open_item("message", {"role": "assistant"}, "output_text")
        listed = [logprob_entry(lp) for lp in logprobs] if self.spec.include_logprobs else []
        self._open["content"][0]["logprobs"].extend(listed)  # type: ignore[index]
        self._delta("response.output_text.delta", text, logprobs=listed)

    def call(self, call: ToolCall) -> None:
        self._close()
        item = {"id": _id("fc"), "type": "function_call", "status": "in_progress",
                "call_id": call.id, "name": call.name, "arguments": ""}
        index = len(self.output)
        self.output.append(item)
        self._event("response.output_item.added", output_index=index, item=item)
        self._event("response.function_call_arguments.delta", item_id=item["id"],
                    output_index=index, delta=call.arguments)
        item.update(arguments=call.arguments, status="completed")
        self._event("response.function_call_arguments.done", item_id=item["id"],
                    output_index=index, name=call.name, arguments=call.arguments)
        self._event("response.output_item.done", output_index=index, item=item)

    def finish(self, reason: str, usage: dict[str, Any], figures: Figures) -> None:
        """The engine's finish reason -> completed, or incomplete at max_output_tokens."""
        if reason == "length":
            self.incomplete_reason = "max_output_tokens"
        if not self.output:  # an empty answer is still a message
            self._open_item("message", {"role": "assistant"}, "output_text")
        self._close("incomplete" if self.incomplete_reason else "completed")
        self.status = "incomplete" if self.incomplete_reason else "completed"
        self.usage, self.figures = usage, figures
        self._event(f"response.{self.status}", response=self.response)

    def fail(self, error: dict[str, Any]) -> None:
        """The engine failed after the stream began: `response.failed`, the error inside."""
        self._close("incomplete")
        self.status = "failed"
        self.error = {"code": "server_error", "message": error["message"]}
        self._event("response.failed", response=self.response)

    def _open_item(self, kind: str, fields: dict[str, Any], part: str) -> None:
        if self._open is not None and self._open["type"] == kind:
            return
        self._close()
        empty = {"type": part, "text": ""}
        if part == "output_text":
            empty.update(annotations=[], logprobs=[])
        item = {"id": _id("msg" if kind == "message" else "rs"), "type": kind,
                "status": "in_progress", **fields, "content": [empty]}
        self._open = item
        index = len(self.output)
        self.output.append(item)
        self._event("response.output_item.added", output_index=index,
                    item={**item, "content": []})
        self._event("response.content_part.added", item_id=item["id"], output_index=index,
                    content_index=0, part=empty)

    def _delta(self, kind: str, text: str, **extra: Any) -> None:
        item = self._open
        assert item is not None
        self._pieces.append(text)
        self._event(kind, item_id=item["id"], output_index=len(self.output) - 1,
                    content_index=0, delta=text, **extra)

    def _close(self, status: str = "completed") -> None:
        item, self._open = self._open, None
        if item is None:
            return
        index = self.output.index(item)
        part = item["content"][0]
        part["text"], self._pieces = "".join(self._pieces), []
        kind = "output_text" if part["type"] == "output_text" else "reasoning_text"
        extra = {"logprobs": part["logprobs"]} if kind == "output_text" else {}
        item["status"] = status
        if kind == "reasoning_text" and self.spec.include_reasoning:
            item["encrypted_content"] = reasoning_token(part["text"])
        self._event(f"response.{kind}.done", item_id=item["id"], output_index=index,
                    content_index=0, text=part["text"], **extra)
        self._event("response.content_part.done", item_id=item["id"], output_index=index,
                    content_index=0, part=part)
        self._event("response.output_item.done", output_index=index, item=item)

    def _event(self, kind: str, **fields: Any) -> None:
        """Queue an event as things stand now (streaming only): a response, item or part in it
        is copied, since the builder goes on changing its own."""
        if self._events is None:
            return
        if not kind.endswith(".delta"):
            fields = _snapshot(fields)
        self._events.append({"type": kind, "sequence_number": self._sequence, **fields})
        self._sequence += 1


def _snapshot(value: Any) -> Any:
    """A copy of the objects and lists the builder may still change (the response, its items
    and parts); a logprob entry never changes once made, so a list of them is copied, not its
    entries (a 4096-token answer's last events took 400 ms with every entry copied)."""
    if isinstance(value, dict):
        return {k: list(v) if k == "logprobs" and isinstance(v, list) else _snapshot(v)
                for k, v in value.items()}
    if isinstance(value, list):
        return [_snapshot(v) for v in value]
    return value


def stored_record(builder: ResponseBuilder, owner: str) -> dict[str, Any]:
    """What the store keeps: the response, its input items, and the responses before it in
    its conversation (their ids, oldest first: each turn is stored once, in its own record)."""
    spec = builder.spec
    return {"owner": owner, "response": builder.response,
            "input_items": list(spec.input_items), "ancestors": list(spec.ancestors),
            "logged": spec.background and spec.stream}  # an event log (GET with stream)


def conversation(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """A conversation's items from its responses' records, oldest first: each one's input
    items, then its output."""
    return [item for record in records
            for item in (*record["input_items"], *record["response"]["output"])]


def input_items_page(items: list[dict[str, Any]], query: dict[str, str]) -> dict[str, Any]:
    """A page of items, as `GET /v1/responses/{id}/input_items` and `GET
    /v1/conversations/{id}/items` list them (`limit` 1-100, default 20; `order` desc (default)
    or asc; `after` an item id)."""
    unknown = sorted(set(query) - {"limit", "order", "after"})
    if unknown:
        raise InvalidRequest(f"'{unknown[0]}' is not a query parameter Strata reads here: it "
                             "reads limit, order, after", unknown[0], code="unsupported_parameter")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise InvalidRequest("'limit' must be an integer from 1 to 100", "limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("'order' must be 'asc' or 'desc'", "order")
    ordered = items if order == "asc" else items[::-1]
    if "after" in query:
        ids = [item["id"] for item in ordered]
        if query["after"] not in ids:
            raise InvalidRequest(f"'after' names {shown(query['after'])}, which is not an item "
                                 "of this list", "after")
        ordered = ordered[ids.index(query["after"]) + 1:]
    page = ordered[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > limit}
