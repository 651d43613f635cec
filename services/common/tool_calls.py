"""The tool-call syntaxes Strata knows, shared by the engine (which detects a chat template's
and builds grammars for it) and the gateway (which parses calls out of the text).

    hermes   <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>   (Qwen2.5/Qwen3)
    glm45    <tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n...</tool_call>
             (GLM-4.5/4.6/4.7: a string V as written, any other value as JSON)
    harmony  <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
             (gpt-oss: every answer is channeled messages, gateway/harmony.py)
"""

from __future__ import annotations

# format -> (the marker that opens a call, the one that closes it)
TOOL_CALL_MARKERS = {"hermes": ("<tool_call>", "</tool_call>"),
                     "glm45": ("<tool_call>", "</tool_call>")}
# glm45's key/value tags
ARG_KEY, ARG_KEY_END, ARG_VALUE, ARG_VALUE_END = ("<arg_key>", "</arg_key>", "<arg_value>",
                                                  "</arg_value>")
# formats whose chat answers are channeled messages (reasoning, answer, calls) marked by
# special tokens: the engine keeps those in the text of a chat request, the gateway splits it
CHANNELED = frozenset({"harmony"})
# formats whose chat template iterates a call's arguments (`arguments.items()`): the history's
# calls reach it with their arguments as an object, not as JSON text
ARGUMENTS_AS_OBJECT = frozenset({"glm45"})


def template_tool_call_format(chat_template: str | None) -> str:
    """The syntax a chat template teaches its model; "" when none Strata parses. GLM's
    templates open calls with <tool_call> too: its key tags tell them apart."""
    if not chat_template:
        return ""
    if "<|channel|>" in chat_template:
        return "harmony"
    if "<tool_call>" not in chat_template:
        return ""
    return "glm45" if ARG_KEY in chat_template else "hermes"
