"""The tool-call syntaxes Strata knows, shared by the engine (which detects a chat template's
and builds grammars for it) and the gateway (which parses calls out of the text).

    hermes   <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>   (Qwen2.5/Qwen3)
"""

from __future__ import annotations

# format -> (the marker that opens a call, the one that closes it)
TOOL_CALL_MARKERS = {"hermes": ("<tool_call>", "</tool_call>")}


def template_tool_call_format(chat_template: str | None) -> str:
    """The syntax a chat template teaches its model; "" when none Strata parses."""
    return next((fmt for fmt, (opening, _) in TOOL_CALL_MARKERS.items()
                 if chat_template and opening in chat_template), "")
