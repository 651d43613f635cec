"""Tokenizer: tokenizer.json via the `tokenizers` library (or a tiktoken.model vocabulary,
Kimi-K2's, converted to one: model/tiktoken_vocab.py), chat template via sandboxed jinja2.

`encode` never inserts special tokens on its own (no surprise BOS); special tokens written in the
text (e.g. `<|im_start|>`) map to their ids. The chat template comes from tokenizer_config.json's
`chat_template` (a string, or a list of named templates) or a `chat_template.jinja` file.
"""

from __future__ import annotations

import copy
import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from services.common.tool_calls import ARGUMENTS_AS_OBJECT, template_tool_call_format
from services.engine.model.config import CheckpointError, find_gguf


class ChatTemplateError(ValueError):
    """The model has no chat template, or rendering it failed (e.g. bad message roles)."""


class Tokenizer:
    def __init__(self, model_dir: Path):
        model_dir = Path(model_dir)
        self._template: jinja2.Template | None = None
        if (gguf_path := find_gguf(model_dir)) is not None:
            self._init_gguf(gguf_path)
            return
        from services.engine.model.tiktoken_vocab import TIKTOKEN_FILE, tiktoken_tokenizer

        path = model_dir / "tokenizer.json"
        cfg = _read_json(model_dir / "tokenizer_config.json")
        if path.is_file():
            self._tok = HFTokenizer.from_file(str(path))
            self._byte_level = "ByteLevel" in json.dumps(
                json.loads(path.read_text()).get("decoder"))
        elif (model_dir / TIKTOKEN_FILE).is_file():
            self._tok = tiktoken_tokenizer(model_dir, cfg)
            self._byte_level = True
        else:
            raise CheckpointError(f"{model_dir} has no tokenizer.json (nor {TIKTOKEN_FILE})")
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.chat_template = _chat_template(model_dir, cfg)
        self.eos_token_ids = self._eos_ids(model_dir)

    def _init_gguf(self, path: Path) -> None:
        from services.engine.model.gguf_reader import gguf_tokenizer

        parts = gguf_tokenizer(path)  # byte-level BPE only (CheckpointError otherwise)
        self._tok = parts["tokenizer"]
        self.bos_token, self.eos_token = parts["bos_token"], parts["eos_token"]
        self.chat_template = parts["chat_template"]
        self.eos_token_ids = parts["eos_token_ids"]
        self._byte_level = True

    @functools.cached_property
    def tool_call_format(self) -> str:
        """How the chat template has the model write tool calls ("hermes": <tool_call> blocks
        of JSON); "" when it teaches none Strata parses."""
        return template_tool_call_format(self.chat_template)

    @functools.cached_property
    def named_roles(self) -> frozenset[str]:
        """The roles whose messages' `name` (OpenAI's participant name) this chat template shows
        the model. Each role's probe conversation is rendered with a marker name on that role's
        message; the role counts where the marker appears in the text (most templates drop
        names; a conversation a template refuses, a system message in Gemma's, counts as not
        shown)."""
        # a call's arguments as the engine renders them (ChatTurn.as_template_message)
        arguments = {} if self.tool_call_format in ARGUMENTS_AS_OBJECT else "{}"
        shown = set()
        for role, (messages, at) in _NAME_PROBES.items():
            probe = copy.deepcopy(messages)
            probe[at]["name"] = marker = f"strataname{role}"
            for m in probe:
                for call in m.get("tool_calls", ()):
                    call["function"]["arguments"] = arguments
            try:
                if marker in self.apply_chat_template(probe):
                    shown.add(role)
            except (ChatTemplateError, TypeError, ValueError):
                pass  # the template refuses this conversation: no name shown
        return frozenset(shown)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token stands for (a byte-level token may be part of a UTF-8
        character, which `decode` would turn into U+FFFD)."""
        token = self._tok.id_to_token(token_id) or ""
        if self._byte_level and all(ch in _UNICODE_TO_BYTE for ch in token):
            return bytes(_UNICODE_TO_BYTE[ch] for ch in token)
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            return bytes([int(token[3:5], 16)])  # sentencepiece byte fallback
        return self.decode([token_id], skip_special_tokens=False).encode()

    @functools.cached_property
    def fim_tokens(self) -> tuple[str, str, str] | None:
        """The tokens a fill-in-the-middle prompt is written with, prefix-suffix-middle order:
        `PRE prompt SUF suffix MID`, the model writing the middle. None where the vocabulary
        has no such set (Qwen's, DeepSeek-Coder's and StarCoder's are known)."""
        return next((fim for fim in FIM_TOKENS
                     if all(self.token_to_id(t) is not None for t in fim)), None)

    @functools.cached_property
    def template_variables(self) -> frozenset[str]:
        """The variables the chat template reads from its caller (beyond its own globals):
        what chat_template_kwargs may set. Empty without a template."""
        if self.chat_template is None:
            return frozenset()
        try:
            return frozenset(jinja2.meta.find_undeclared_variables(
                _ENV.parse(self.chat_template))) - _ENV.globals.keys()
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from e

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template")
        if self._template is None:
            self._template = _compile(self.chat_template)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **extra,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e

    def _eos_ids(self, model_dir: Path) -> set[int]:
        ids: set[int] = set()
        if self.eos_token is not None and (tid := self.token_to_id(self.eos_token)) is not None:
            ids.add(tid)
        for name in ("generation_config.json", "config.json"):
            value = _read_json(model_dir / name).get("eos_token_id")
            ids.update(value if isinstance(value, list) else [] if value is None else [value])
        return ids


# Fill-in-the-middle token sets (prefix, suffix, middle): Qwen2.5/Qwen3(-Coder)'s,
# DeepSeek-Coder's, StarCoder's.
FIM_TOKENS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
              ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
              ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))

_PROBE_CALL = {"id": "call_0", "type": "function", "function": {"name": "probe", "arguments": ""}}
# Tokenizer.named_roles' probes: role -> (a conversation, the index of that role's message).
_NAME_PROBES: dict[str, tuple[list[dict[str, Any]], int]] = {
    "system": ([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], 0),
    "user": ([{"role": "user", "content": "u"}], 0),
    "assistant": ([{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"},
                   {"role": "user", "content": "v"}], 1),
    "tool": ([{"role": "user", "content": "u"},
              {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]},
              {"role": "tool", "content": "r", "tool_call_id": "call_0"}], 2),
}


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest are shifted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_UNICODE_TO_BYTE = {ch: b for b, ch in _byte_to_unicode().items()}


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    """tokenizer_config tokens are strings or serialized AddedTokens ({"content": ...})."""
    return value.get("content") if isinstance(value, dict) else value


def _chat_template(model_dir: Path, cfg: dict[str, Any]) -> str | None:
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default", next(iter(named.values()), None))
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    return template


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


_ENV = _environment()


def _compile(source: str) -> jinja2.Template:
    try:
        return _ENV.from_string(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from e
