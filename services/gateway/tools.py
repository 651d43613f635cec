"""Tool calling at the gateway: the request's `tools` and `tool_choice` validated, and the
model's tool calls parsed out of its text in the syntax its chat template teaches it (the
engine says which in Started.tool_call_format).

    hermes   <tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>
             (Qwen2.5/Qwen3, the default model; one block per call)
    glm45    <tool_call>get_weather\\n<arg_key>city</arg_key>\\n<arg_value>Paris</arg_value>\\n
             </tool_call>  (GLM-4.5/4.6/4.7: a value is text where the function's parameters
             say string, else JSON, falling back to text)
    deepseek_v3, deepseek_v31, kimi_k2, minimax_m2: each call between its own markers, the
             turn's calls between section markers, which are not content (common/tool_calls.py)

`ToolCallParser.feed(text)` takes the output as it streams and gives back what can be said
already: content (text outside the blocks; a possible start of a block is held back) and each
call once its block has closed. A block that does not parse stays content. `finish()` gives
what was held back.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from services.common.tool_calls import (
    ARG_KEY,
    ARG_KEY_END,
    ARG_VALUE,
    ARG_VALUE_END,
    DS_SEP,
    KIMI_ARGUMENTS,
    SECTION_MARKERS,
    TOOL_CALL_MARKERS,
)
from services.gateway.errors import InvalidRequest, refuse_unknown_keys

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128
# The keys read at each level (openapi.py's Tool, ToolChoice and ToolCall list exactly these;
# any other is refused by name). A history call's `index` is its place in the message's
# tool_calls, as a stream's delta numbered it: clients that rebuild calls from deltas send it.
TOOL_FIELDS = frozenset({"type", "function"})
FUNCTION_FIELDS = frozenset({"name", "description", "parameters", "strict"})
CHOICE_FUNCTION_FIELDS = frozenset({"name"})
CALL_FIELDS = frozenset({"id", "type", "function", "index"})
CALL_FUNCTION_FIELDS = frozenset({"name", "arguments"})


@dataclass(frozen=True)
class Tools:
    """A request's tools as the engine takes them."""

    tools_json: str  # the `tools` array, as JSON text, for the chat template
    names: tuple[str, ...]
    choice: str  # "auto", "required", or the one function's name
    parallel: bool
    allowed: tuple[str, ...] = ()  # allowed_tools: the functions the answer may call (): any

    def parameters(self) -> dict[str, dict]:
        """Each function's parameters schema ({} where it declares none)."""
        return {t["function"]["name"]: t["function"].get("parameters") or {}
                for t in json.loads(self.tools_json)}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def parse_tools(body: dict[str, Any]) -> Tools | None:
    """`tools`, `tool_choice`, `parallel_tool_calls` -> Tools (None: no tools reach the model,
    also for tool_choice "none")."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequest("'parallel_tool_calls' must be true or false",
                             "parallel_tool_calls")
    if tools is None:
        if choice not in (None, "none"):
            raise InvalidRequest("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or not 1 <= len(tools) <= MAX_TOOLS:
        raise InvalidRequest(f"'tools' must be an array of 1-{MAX_TOOLS} tools", "tools")
    names = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(tools))
    if len(set(names)) < len(names):
        raise InvalidRequest("'tools' names a function twice", "tools")
    if choice is None or choice == "auto":
        choice = "auto"
    elif choice == "none":
        return None
    elif choice == "required":
        pass
    elif isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("function"), dict):
        refuse_unknown_keys(choice, TOOL_FIELDS, "tool_choice", "'tool_choice'")
        refuse_unknown_keys(choice["function"], CHOICE_FUNCTION_FIELDS, "tool_choice.function",
                            "'tool_choice.function'")
        name = choice["function"].get("name")
        if name not in names:
            raise InvalidRequest(f"'tool_choice' names {name!r}, which is not in 'tools'",
                                 "tool_choice.function.name")
        choice = name
    elif isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        choice, allowed = _allowed_tools(choice, names)
        return Tools(json.dumps(tools), names, choice, True if parallel is None else parallel,
                     allowed)
    else:
        raise InvalidRequest("'tool_choice' must be 'none', 'auto', 'required', "
                             "{'type': 'function', 'function': {'name': ...}} or "
                             "{'type': 'allowed_tools', 'allowed_tools': {'mode': ..., "
                             "'tools': [...]}}", "tool_choice")
    return Tools(json.dumps(tools), names, choice, True if parallel is None else parallel)


def _allowed_tools(choice: dict[str, Any], names: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    """{'type': 'allowed_tools', 'allowed_tools': {'mode': 'auto' | 'required', 'tools':
    [{'type': 'function', 'function': {'name': ...}}, ...]}} -> (mode, the names): every tool
    stays in the prompt; the answer may call only these."""
    refuse_unknown_keys(choice, frozenset({"type", "allowed_tools"}), "tool_choice",
                        "'tool_choice'")
    inner = choice.get("allowed_tools")
    if not isinstance(inner, dict):
        raise InvalidRequest("'tool_choice.allowed_tools' must be an object with 'mode' and "
                             "'tools'", "tool_choice.allowed_tools")
    refuse_unknown_keys(inner, frozenset({"mode", "tools"}), "tool_choice.allowed_tools",
                        "'tool_choice.allowed_tools'")
    mode, listed = inner.get("mode"), inner.get("tools")
    if mode not in ("auto", "required"):
        raise InvalidRequest("'tool_choice.allowed_tools.mode' must be 'auto' or 'required'",
                             "tool_choice.allowed_tools.mode")
    if not isinstance(listed, list) or not listed:
        raise InvalidRequest("'tool_choice.allowed_tools.tools' must list at least one "
                             "function", "tool_choice.allowed_tools.tools")
    allowed = []
    for i, tool in enumerate(listed):
        param = f"tool_choice.allowed_tools.tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" \
                or not isinstance(tool.get("function"), dict):
            raise InvalidRequest(f"'{param}' must be {{'type': 'function', 'function': "
                                 "{'name': ...}}", param)
        refuse_unknown_keys(tool, TOOL_FIELDS, param, f"'{param}'")
        refuse_unknown_keys(tool["function"], CHOICE_FUNCTION_FIELDS, f"{param}.function",
                            f"'{param}.function'")
        name = tool["function"].get("name")
        if name not in names:
            raise InvalidRequest(f"'{param}' names {name!r}, which is not in 'tools'",
                                 f"{param}.function.name")
        allowed.append(name)
    return mode, tuple(dict.fromkeys(allowed))


def _tool(raw: Any, param: str) -> str:
    if not isinstance(raw, dict) or raw.get("type") != "function" \
            or not isinstance(raw.get("function"), dict):
        raise InvalidRequest(f"{param} must be {{'type': 'function', 'function': {{...}}}}",
                             param)
    function = raw["function"]
    refuse_unknown_keys(raw, TOOL_FIELDS, param, "a tool")
    refuse_unknown_keys(function, FUNCTION_FIELDS, f"{param}.function", "a tool's function")
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise InvalidRequest(f"{param}.function.name must be 1-64 letters, digits, '_' or '-'",
                             f"{param}.function.name")
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise InvalidRequest(f"{param}.function.description must be a string",
                             f"{param}.function.description")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidRequest(f"{param}.function.parameters must be a JSON Schema object",
                             f"{param}.function.parameters")
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise InvalidRequest(f"{param}.function.strict must be true or false",
                             f"{param}.function.strict")
    return name


def parse_history_calls(raw: Any, param: str) -> tuple[ToolCall, ...]:
    """An assistant message's `tool_calls` (the history of a conversation with tools)."""
    if not isinstance(raw, list):
        raise InvalidRequest(f"{param} must be an array of tool calls", param)
    calls = []
    for i, call in enumerate(raw):
        where = f"{param}[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or call.get("type", "function") != "function" \
                or not isinstance(function, dict) or not isinstance(call.get("id"), str):
            raise InvalidRequest(f"{where} must be {{'id': ..., 'type': 'function', "
                                 "'function': {'name': ..., 'arguments': ...}}", where)
        refuse_unknown_keys(call, CALL_FIELDS, where, "a tool call")
        refuse_unknown_keys(function, CALL_FUNCTION_FIELDS, f"{where}.function",
                            "a tool call's function")
        index = call.get("index")
        if index is not None and (type(index) is not int or index != i):
            raise InvalidRequest(f"{where}.index must be {i}, the call's place in tool_calls "
                                 f"(got {index!r})", f"{where}.index")
        name, arguments = function.get("name"), function.get("arguments")
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"{where}.function.name must be a string",
                                 f"{where}.function.name")
        if not isinstance(arguments, str):
            raise InvalidRequest(f"{where}.function.arguments must be a string of JSON",
                                 f"{where}.function.arguments")
        try:
            json.loads(arguments)
        except ValueError:
            raise InvalidRequest(f"{where}.function.arguments is not valid JSON",
                                 f"{where}.function.arguments") from None
        calls.append(ToolCall(call["id"], name, arguments))
    return tuple(calls)


class ToolCallParser:
    """The model's output -> content pieces and tool calls, as it streams (see the module
    docstring). Content is trimmed as one string would be: leading whitespace dropped, trailing
    whitespace held until more content follows."""

    def __init__(self, fmt: str, names: tuple[str, ...],
                 parameters: dict[str, dict] | None = None) -> None:
        """parameters: each function's parameters schema (the key/value syntaxes, glm45,
        qwen3_xml and minimax_m2, read a value as text where it says string)."""
        if fmt not in TOOL_CALL_MARKERS:
            raise ValueError(f"tool-call format {fmt!r} is not one of "
                             f"{', '.join(TOOL_CALL_MARKERS)}")
        self.open, self.close = TOOL_CALL_MARKERS[fmt]
        self.section = SECTION_MARKERS.get(fmt, ())  # dropped from the content
        self.format = fmt
        self.names = set(names)
        self.parameters = parameters or {}
        self.calls: list[ToolCall] = []
        self._buffer = ""
        self._in_call = False
        self._said = False  # any content emitted yet
        self._space = ""  # whitespace held back

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content that can be sent now, calls that just closed)."""
        self._buffer += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if not self._in_call:
                start = self._buffer.find(self.open)
                if start < 0:
                    keep = max(partial_suffix(self._buffer, m) for m in (self.open, *self.section))
                    content.append(self._buffer[:len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    break
                content.append(self._buffer[:start])
                self._buffer = self._buffer[start + len(self.open):]
                self._in_call = True
            else:
                end = self._buffer.find(self.close)
                if end < 0:
                    break
                body, self._buffer = self._buffer[:end], self._buffer[end + len(self.close):]
                self._in_call = False
                call = self._call(body)
                if call is None:
                    content.append(self.open + body + self.close)
                else:
                    calls.append(call)
                    self.calls.append(call)
        return self._trim(self._unsectioned("".join(content))), calls

    def take_reasoning(self) -> str:
        """Reasoning parsed since the last call: none in these syntaxes (harmony.py's has)."""
        return ""

    def finish(self) -> str:
        """What was held back (an unclosed block is content)."""
        rest = (self.open if self._in_call else "") + self._buffer
        self._buffer, self._in_call = "", False
        return self._trim(self._unsectioned(rest), last=True)

    def _unsectioned(self, text: str) -> str:
        for marker in self.section:
            text = text.replace(marker, "")
        return text

    def _call(self, body: str) -> ToolCall | None:
        if self.format == "glm45":
            return self._key_value_call(body)
        if self.format == "qwen3_xml":
            return self._xml_call(body)
        if self.format == "minimax_m2":
            return self._invoke_call(body)
        if self.format in ("deepseek_v3", "deepseek_v31", "kimi_k2"):
            return self._marked_call(body)
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or value.get("name") not in self.names:
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                json.loads(arguments)
            except ValueError:
                return None
        else:
            arguments = json.dumps(arguments)
        return ToolCall(f"call_{uuid.uuid4().hex[:24]}", value["name"], arguments)

    def _marked_call(self, body: str) -> ToolCall | None:
        """DeepSeek's `[function<sep>]NAME[\\n```json\\n]ARGS[\\n```]` and Kimi's
        `functions.NAME:I<argument_begin>ARGS`: the name, then JSON arguments."""
        if self.format == "kimi_k2":
            head, sep, arguments = body.partition(KIMI_ARGUMENTS)
            name = head.strip().removeprefix("functions.").rpartition(":")[0]
        else:
            head, sep, arguments = body.partition(DS_SEP)
            name = head.strip()
            if self.format == "deepseek_v3":  # the type before the separator, then the name
                name, _, arguments = arguments.partition("\n")
                name = name.strip()
                fence = re.fullmatch(r"\s*```(?:json)?\s*\n(.*?)\n?\s*```\s*", arguments, re.S)
                arguments = fence.group(1) if fence else arguments
                sep = sep if head.strip() == "function" else ""
        if not sep or name not in self.names:
            return None
        try:
            value = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return None
        if not isinstance(value, dict):
            return None
        index = len(self.calls)
        call_id = (f"functions.{name}:{index}" if self.format == "kimi_k2"  # Kimi's own ids
                   else f"call_{uuid.uuid4().hex[:24]}")
        return ToolCall(call_id, name, json.dumps(value))

    def _xml_call(self, body: str) -> ToolCall | None:
        """qwen3_xml: <function=NAME> and its <parameter=K> blocks, nothing else around."""
        m = _XML_FUNCTION.fullmatch(body)
        return None if m is None else self._pairs_call(m.group(1), m.group(2), _XML_PARAMETER)

    def _invoke_call(self, body: str) -> ToolCall | None:
        """minimax_m2: the rest of `<invoke name="NAME">`, then <parameter name="K"> blocks."""
        name, quote, rest = body.partition('">')
        return self._pairs_call(name, rest, _INVOKE_PARAMETER) if quote else None

    def _key_value_call(self, body: str) -> ToolCall | None:
        """glm45: the name up to the first line's end (or the first key), then key/value
        pairs."""
        head, key, tail = body.partition(ARG_KEY)
        return self._pairs_call(head, key + tail, _KEY_VALUE)

    def _pairs_call(self, name: str, rest: str, pairs: re.Pattern[str]) -> ToolCall | None:
        """A key/value syntax's call: `rest` nothing but `pairs` (groups: key, value text),
        each value typed by the function's parameters; None where anything else is there."""
        name = name.strip()
        if name not in self.names:
            return None
        properties = self.parameters.get(name, {}).get("properties") or {}
        arguments: dict[str, Any] = {}
        at = 0
        for m in pairs.finditer(rest):
            if rest[at:m.start()].strip():
                return None
            key = m.group(1).strip()
            arguments[key] = _typed_value(m.group(2), properties.get(key))
            at = m.end()
        if rest[at:].strip():
            return None
        return ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(arguments))

    def _trim(self, text: str, last: bool = False) -> str:
        if not self._said:
            text = text.lstrip()
        if not text:
            return ""
        body = text.rstrip()
        if not body:  # only whitespace: held until content follows
            self._space += text
            return ""
        out = self._space + body
        self._space = "" if last else text[len(body):]
        self._said = True
        return out


_KEY_VALUE = re.compile(re.escape(ARG_KEY) + r"(.*?)" + re.escape(ARG_KEY_END) + r"\s*"
                        + re.escape(ARG_VALUE) + r"(.*?)" + re.escape(ARG_VALUE_END), re.DOTALL)


_XML_FUNCTION = re.compile(r"\s*<function=([^>]+)>(.*?)</function>\s*", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_INVOKE_PARAMETER = re.compile(r'<parameter name="([^"]+)">(.*?)</parameter>', re.DOTALL)


def _typed_value(raw: str, schema: Any) -> Any:
    """A glm45 / qwen3_xml value: the text itself where the parameter is a string (their
    templates write strings as they are), else its JSON, else the text."""
    if isinstance(schema, dict) and schema.get("type") == "string":
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
