"""Server-sent events framing for OpenAI streams: `data: <json>\\n\\n`, ended by `data: [DONE]`."""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"


def event(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def named(body: dict[str, Any]) -> bytes:
    """An event of the Responses API's stream: its type as the SSE event name too."""
    return (b"event: " + body["type"].encode() + b"\ndata: "
            + json.dumps(body, separators=(",", ":")).encode() + b"\n\n")
