"""gpt-oss's harmony answers, split the way the API returns them.

A harmony model answers in messages, each a header and a body between special tokens (the
engine keeps them in a chat answer's text for such a model):

    <|channel|>analysis<|message|>Let me think ...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
        <|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny in Paris.<|return|>

    channel analysis                      -> message.reasoning_content
    channel final, or commentary to none  -> message.content (commentary: a preamble)
    a recipient functions.NAME            -> a tool call, its body the arguments JSON

The model's stop tokens (<|return|>, <|call|>) are not in the text; `finish()` ends the open
message. OpenAI's openai-harmony package parses this from token ids, but it fetches its
tokenizer's vocabulary over the network on first use, which an offline server cannot: the
grammar is small enough to split here from the text, as it streams, with the interface of
tools.ToolCallParser (`feed` -> content and closed calls, `take_reasoning` for the analysis).
"""

from __future__ import annotations

import json
import re
import uuid

from services.gateway.tools import ToolCall, partial_suffix

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")  # what closes a message
FUNCTIONS = "functions."
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=\s|<\||$)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
_SPECIAL = re.compile(r"<\|\w+\|>")


class HarmonyParser:
    def __init__(self, names: tuple[str, ...] = ()) -> None:
        self.names = set(names)  # the functions the request offered
        self.calls: list[ToolCall] = []
        self._buffer = ""
        self._kind: str | None = None  # None: reading a header; else the open message's
        self._name = ""  # the open call's function
        self._reasoning: list[str] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """(answer text that can be sent now, calls that just closed)."""
        self._buffer += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._kind is None:
                at = self._buffer.find(MESSAGE)
                if at < 0:
                    break
                self._open(self._buffer[:at])
                self._buffer = self._buffer[at + len(MESSAGE):]
                continue
            ends = [(i, m) for m in ENDS if (i := self._buffer.find(m)) >= 0]
            if not ends:
                if self._kind != "call":  # stream the body, less a possible marker start
                    keep = max(partial_suffix(self._buffer, m) for m in ENDS)
                    self._emit(self._buffer[:len(self._buffer) - keep], content)
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            at, marker = min(ends)
            self._close(self._buffer[:at], content, calls)
            self._buffer = self._buffer[at + len(marker):]
        return "".join(content), calls

    def finish(self) -> str:
        """The open message ended by the stop token (not in the text); what was held back."""
        content: list[str] = []
        if self._kind is None:  # no message opened (not harmony after all): the text is it
            content.append(_SPECIAL.sub("", self._buffer))
        else:
            self._close(self._buffer, content, [])
        self._buffer, self._kind = "", None
        return "".join(content)

    def take_reasoning(self) -> str:
        """The analysis text parsed since the last call."""
        out, self._reasoning = "".join(self._reasoning), []
        return out

    def _open(self, header: str) -> None:
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        to = recipient.group(1) if recipient else ""
        if to.startswith(FUNCTIONS) and to[len(FUNCTIONS):] in self.names:
            self._kind, self._name = "call", to[len(FUNCTIONS):]
        elif channel is not None and channel.group(1) == "analysis":
            self._kind = "reasoning"
        else:  # final, a commentary preamble, or a call to a function not offered: said
            self._kind = "content"

    def _emit(self, text: str, content: list[str]) -> None:
        if not text:
            return
        (self._reasoning if self._kind == "reasoning" else content).append(text)

    def _close(self, body: str, content: list[str], calls: list[ToolCall]) -> None:
        if self._kind == "call":
            try:
                arguments = json.dumps(json.loads(body)) if body.strip() else "{}"
            except ValueError:  # not JSON: the model's text, as it wrote it
                self._kind = "content"
                self._emit(body, content)
            else:
                call = ToolCall(f"call_{uuid.uuid4().hex[:24]}", self._name, arguments)
                calls.append(call)
                self.calls.append(call)
        else:
            self._emit(body, content)
        self._kind = None
