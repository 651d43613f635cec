"""Constrained decoding: the output must match a grammar (JSON Schema, any JSON object, a regular
expression, a Lark grammar), enforced token by token with llguidance.

    OutputConstraint ──Grammars.compile()──> grammar (validated once, cached by its text)
    grammar ──Grammars.guide()──> Guide: one request's matcher
    every step: Guide.start_mask() before the forward (a worker thread, llguidance drops the
                GIL; where the forward leaves a core free), Guide.allowed() in the sampler
                (tokens outside the grammar: -inf),
                Guide.consume(token) for the token taken; Guide.done once the grammar is
                complete (the request then ends with finish reason "stop").

llguidance was chosen over xgrammar (the field's other engine): its wheel has no dependencies
(xgrammar requires transformers and triton, which serving must not need), it builds its token
trie from the checkpoint's tokenizer.json in a few milliseconds, and computes a mask in about
20 µs on the default model's 4096-token vocabulary (docs/benchmarks.md, "Structured output").
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

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

KINDS = ("json_schema", "json_object", "regex", "lark")
# Any JSON object: what OpenAI's response_format {"type": "json_object"} promises.
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# JSON laid out as json.dumps does: no whitespace but one space after "," and ":". A model is
# otherwise free to spend its tokens on blank lines between the fields (a schema's own
# "x-guidance" options override these).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """The constraint is not a grammar llguidance can compile (the message says where)."""


@dataclass(frozen=True)
class OutputConstraint:
    kind: str  # one of KINDS
    text: str = ""  # the schema (JSON text), the regex or the Lark grammar; "" for json_object

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"constraint kind {self.kind!r} is not one of {', '.join(KINDS)}")


@lru_cache(maxsize=256)
def compile_grammar(kind: str, text: str) -> str:
    """The llguidance grammar of a constraint, validated; GrammarError naming the problem."""
    import llguidance

    try:
        if kind in ("json_schema", "json_object"):
            source = JSON_OBJECT_SCHEMA if kind == "json_object" else text
            try:
                json.loads(source)
            except ValueError as exc:
                raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
            grammar = llguidance.LLMatcher.grammar_from_json_schema(source,
                                                                    defaults=JSON_LAYOUT)
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(text)
        else:
            grammar = llguidance.LLMatcher.grammar_from_lark(text)
    except (ValueError, RuntimeError, TypeError) as exc:  # llguidance's own refusals
        raise GrammarError(f"{kind}: {exc}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(f"{kind}: {'; '.join(m.strip() for m in messages)}")
    return grammar


# OpenAI: "omitting parameters defines a function with an empty parameter list"
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


JSON_KINDS = ("json_schema", "json_object")


def json_answer(constraint: OutputConstraint) -> str:
    """A JSON constraint (response_format, guided_json) as a Lark expression, laid out as
    JSON_LAYOUT unless its schema says otherwise; GrammarError for a schema that is no JSON."""
    try:
        schema = json.loads(constraint.text if constraint.kind == "json_schema"
                            else JSON_OBJECT_SCHEMA)
    except ValueError as exc:
        raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise GrammarError("the JSON schema must be an object")
    return _json_rule(schema)


def _json_rule(schema: dict) -> str:
    """Lark's inline JSON Schema, laid out as JSON_LAYOUT unless the schema says otherwise."""
    return "%json " + json.dumps({"x-guidance": JSON_LAYOUT, **schema})


def final_answer_constraint(constraint: OutputConstraint) -> OutputConstraint:
    """harmony's chat answer held to a JSON constraint: its reasoning first if it wants (an
    analysis message), then the final message, whose content is the JSON."""
    return OutputConstraint("lark", "\n".join([
        f'start: analysis? <|channel|> "final" <|message|> {json_answer(constraint)}',
        HARMONY_ANALYSIS]) + "\n")


def tool_call_constraint(fmt: str, tools_json: str, choice: str, parallel: bool,
                         answer: OutputConstraint | None = None) -> OutputConstraint:
    """The output of a request with tools, held to the template's call syntax and each
    function's parameters schema.

    choice "required" or a function's name: one call block (several, newline-separated, with
    parallel calls), each naming one of the functions (the named one) with arguments its
    parameters schema allows. choice "auto" (asked for where a function is `strict`, or where
    the answer is held to JSON): the calls, held as above, or instead the answer: `answer`
    (a JSON constraint), else free text that never opens a call, which may also precede them.
    """
    functions = [t["function"] for t in json.loads(tools_json)]
    if choice not in ("required", "auto"):
        functions = [f for f in functions if f["name"] == choice]
    if fmt == "harmony":  # auto: the final message instead, free or the JSON answer
        if choice != "auto":
            return _harmony_call(functions)
        return _harmony_call(functions, "/(?s:.*)/" if answer is None else json_answer(answer))
    if fmt in KEY_VALUE_LAYOUTS:
        opening, rules = _key_value_calls(fmt, functions, parallel)
    elif fmt in SECTION_MARKERS:
        opening, rules = _marked_calls(fmt, functions, parallel)
    else:
        opening, rules = _json_calls(fmt, functions, parallel)
    if choice != "auto":
        start = [f"start: {opening} after_opening"]
    elif answer is not None:  # a JSON answer begins with "{", a call with its opening
        start = [f"start: {json_answer(answer)} | {opening} after_opening"]
    elif opening.startswith("<|"):  # a special token: no text contains it
        start = [f"start: FREE? ({opening} after_opening)?", "FREE: /(?s:.+)/"]
    else:  # text up to the opening, taken lazily: the first time it appears, the calls begin
        import llguidance

        marker = llguidance.regex_to_lark(re.escape(json.loads(opening)))
        start = ["start: FREE | before_calls after_opening",
                 f"before_calls[lazy]: /(?s:.*){marker}/",
                 f"FREE: /(?s:.*)/ & ~/(?s:.*{marker}.*)/"]
    return OutputConstraint("lark", "\n".join([*start, *rules]) + "\n")


def _json_calls(fmt: str, functions: list[dict], parallel: bool) -> tuple[str, list[str]]:
    """hermes's calls (Qwen's): a JSON object naming the function and holding its arguments
    between the call markers, one block a call."""
    opening, closing = TOOL_CALL_MARKERS[fmt]
    q = json.dumps  # a Lark string literal
    calls = [{"type": "object", "properties": {
        "name": {"const": f["name"]},
        "arguments": f.get("parameters") or NO_PARAMETERS},
        "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    body = _json_rule(calls[0] if len(calls) == 1 else {"anyOf": calls})
    more = f" ({q(chr(10))} call)*" if parallel else ""
    return q(opening), [f"after_opening: {q(chr(10))} body {q(chr(10) + closing)}{more}",
                        f"call: {q(opening + chr(10))} body {q(chr(10) + closing)}",
                        f"body: {body}"]


# glm45 / qwen3_xml / minimax_m2: a call's text around its name, and around each argument's
# key and value
KEY_VALUE_LAYOUTS = {
    "glm45": ("{name}\n", "", f"{ARG_KEY}{{key}}{ARG_KEY_END}\n{ARG_VALUE}",
              f"{ARG_VALUE_END}\n"),
    "qwen3_xml": ("\n<function={name}>\n", "</function>\n", "<parameter={key}>\n",
                  "\n</parameter>\n"),
    "minimax_m2": ('{name}">\n', "", '<parameter name="{key}">', "</parameter>\n"),
}


def _key_value_calls(fmt: str, functions: list[dict],
                     parallel: bool) -> tuple[str, list[str]]:
    """glm45's, qwen3_xml's and minimax_m2's calls: the name, then one key/value block per
    parameter, in the schema's order (the required ones always, the others optionally); a
    string value is text without "<" (one of its enum where it has one, within its minLength /
    maxLength), any other value the JSON its schema allows."""
    opening, closing = TOOL_CALL_MARKERS[fmt]
    name_text, after, key_text, value_end = KEY_VALUE_LAYOUTS[fmt]
    q = json.dumps  # a Lark string literal
    names = " | ".join(f"f{i}" for i in range(len(functions)))
    begin, end = SECTION_MARKERS.get(fmt, ("", ""))  # minimax_m2: its calls in one section
    more = " (" + q("\n") + " call)*" if parallel else ""
    if begin:
        head, rules = q(begin), [f"after_opening: {q(chr(10))} call{more} {q(chr(10) + end)}"]
    else:
        head, rules = q(opening), [f"after_opening: ({names}) {q(closing)}{more}"]
    rules += [f"call: {q(opening)} ({names}) {q(closing)}", "TEXT: /[^<]*/"]
    for i, f in enumerate(functions):
        schema = f.get("parameters") or NO_PARAMETERS
        required = set(schema.get("required") or ())
        parts = []
        for j, (key, prop) in enumerate((schema.get("properties") or {}).items()):
            prop = prop if isinstance(prop, dict) else {}
            if prop.get("type") == "string" and prop.get("enum"):
                value = " | ".join(q(str(v)) for v in prop["enum"])
            elif prop.get("type") == "string":  # its length bounds, where it sets them
                low, high = int(prop.get("minLength", 0)), prop.get("maxLength")
                value = ("TEXT" if not low and high is None
                         else f"/[^<]{{{low},{'' if high is None else int(high)}}}/")
            else:
                value = _json_rule(prop)
            rules.append(f"f{i}_{j}: {q(key_text.format(key=key))} ({value}) {q(value_end)}")
            parts.append(f"f{i}_{j}" if key in required else f"f{i}_{j}?")
        tail = f" {q(after)}" if after else ""
        rules.append(f"f{i}: {q(name_text.format(name=f['name']))} {' '.join(parts)}{tail}")
    return head, rules


def _marked_calls(fmt: str, functions: list[dict], parallel: bool) -> tuple[str, list[str]]:
    """DeepSeek's and Kimi's calls: the section markers around one call (several, with
    parallel calls), each between its call markers, its name and JSON arguments in the
    format's layout. Kimi's markers are special tokens (Lark's <|...|>), DeepSeek's text."""
    def q(value: Any) -> str:
        return json.dumps(value, ensure_ascii=False)

    def mark(text: str) -> str:
        return text if fmt == "kimi_k2" else q(text)
    (begin, end), (opening, closing) = SECTION_MARKERS[fmt], TOOL_CALL_MARKERS[fmt]
    rules = []
    for i, f in enumerate(functions):
        arguments = _json_rule(f.get("parameters") or NO_PARAMETERS)
        if fmt == "deepseek_v3":
            body = (f"{q('function')} {mark(DS_SEP)} {q(f['name'] + chr(10) + '```json' + chr(10))}"
                    f" {arguments} {q(chr(10) + '```')}")
        elif fmt == "deepseek_v31":
            body = f"{q(f['name'])} {mark(DS_SEP)} {arguments}"
        else:
            body = f"{q('functions.' + f['name'] + ':')} /[0-9]/ {mark(KIMI_ARGUMENTS)} {arguments}"
        rules.append(f"call{i}: {mark(opening)} {body} {mark(closing)}")
    calls = " | ".join(f"call{i}" for i in range(len(functions)))
    return mark(begin), [f"after_opening: call{' call*' if parallel else ''} {mark(end)}",
                         f"call: {calls}", *rules]


HARMONY_ANALYSIS = ('analysis: <|channel|> "analysis" <|message|> /[^<]*/ <|end|> <|start|> '
                    '"assistant"')


def _harmony_call(functions: list[dict], final: str | None = None) -> OutputConstraint:
    """harmony's call (gpt-oss): its reasoning first if it wants (an analysis message), then a
    commentary message to one of the functions whose body is JSON its parameters allow, or
    the final message instead, its content `final` (a Lark expression) where given. One call:
    gpt-oss ends its turn at a call (<|call|>) and takes the result in the next."""
    q = json.dumps
    calls = [f"call{i}: <|channel|> {q('commentary to=functions.' + f['name'] + ' ')} "
             f"<|constrain|> \"json\" <|message|> "
             f"{_json_rule(f.get('parameters') or NO_PARAMETERS)}"
             for i, f in enumerate(functions)]
    names = " | ".join(f"call{i}" for i in range(len(functions)))
    if final is not None:
        names += f' | <|channel|> "final" <|message|> {final}'
    return OutputConstraint("lark", "\n".join([
        f"start: analysis? ({names})", HARMONY_ANALYSIS, *calls]) + "\n")


class Grammars:
    """A checkpoint's grammar machinery: its llguidance tokenizer (built at the first
    constrained request) and the threads that compute masks while the forward runs."""

    def __init__(self, tokenizer: Any, vocab_size: int, model_dir: Path | None = None,
                 overlap: bool = True) -> None:
        """overlap: compute masks in a worker thread while the forward runs. Only where the
        forward leaves a core free (a GPU's, or fewer torch threads than cores): measured on
        2 cores with 2 torch threads, the worker slows the forward more than it hides
        (docs/benchmarks.md, "Structured output"), and masks are computed in the sampler."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._model_dir = Path(model_dir) if model_dir is not None else None
        self._ll: Any = None
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="strata-grammar") \
            if overlap else None

    def ll_tokenizer(self) -> Any:
        with self._lock:
            if self._ll is None:
                self._ll = self._build_tokenizer()
            return self._ll

    def _build_tokenizer(self) -> Any:
        import llguidance

        eos = sorted(self._tokenizer.eos_token_ids)
        path = self._model_dir / "tokenizer.json" if self._model_dir is not None else None
        if path is not None and path.is_file():
            return llguidance.LLTokenizer(path.read_text(), n_vocab=self.vocab_size,
                                          eos_token=eos or None)
        # A GGUF checkpoint (its vocabulary is in the file): the tokens' bytes, from ours.
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(
            self._tokenizer, self.vocab_size, eos)), n_vocab=self.vocab_size)

    def guide(self, constraint: OutputConstraint) -> Guide:
        """A matcher for one request; GrammarError when the constraint does not compile."""
        import llguidance

        grammar = compile_grammar(constraint.kind, constraint.text)
        matcher = llguidance.LLMatcher(self.ll_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{constraint.kind}: {matcher.get_error()}")
        return Guide(matcher, self.vocab_size, self._pool)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


class Guide:
    """One request's place in its grammar."""

    def __init__(self, matcher: Any, vocab_size: int, pool: ThreadPoolExecutor | None) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._pool = pool
        self._pending: Future[bytes] | None = None
        self.masks = 0
        self.compute_s = 0.0  # llguidance computing masks (beside the forward, with a worker)
        self.wait_s = 0.0  # the sampler waiting for (or computing) masks and unpacking them

    def start_mask(self) -> None:
        """Begin computing the next token's mask (the engine calls this before the forward;
        without a worker the sampler computes it when it asks)."""
        if self._pending is None and self._pool is not None:
            self._pending = self._pool.submit(self._compute)

    def _compute(self) -> bytes:
        t0 = time.perf_counter()
        packed = self._matcher.compute_bitmask()
        self.compute_s += time.perf_counter() - t0
        return packed

    def allowed(self) -> torch.Tensor:
        """[vocab] bool: the tokens the grammar takes next (EOS only once it is complete)."""
        t0 = time.perf_counter()
        self.start_mask()
        packed = self._compute() if self._pending is None else self._pending.result()
        self._pending = None
        bits = np.unpackbits(np.frombuffer(packed, dtype=np.uint8), bitorder="little")
        self.wait_s += time.perf_counter() - t0
        self.masks += 1
        return torch.from_numpy(bits[:self.vocab_size].astype(bool))

    def valid_prefix(self, draft: list[int]) -> int:
        """How many of a speculative draft's tokens the grammar takes, in order."""
        self._settle()
        return int(self._matcher.validate_tokens(draft)) if draft else 0

    def row_masks(self, draft: list[int]) -> torch.Tensor:
        """[k+1, vocab] bool: the masks of a verification's rows, the grammar's state after
        each prefix of the draft (which valid_prefix has cut to what it takes)."""
        rows = [self.allowed()]
        for token in draft:
            self.consume(token)
            rows.append(self.allowed())
        if draft and not self._matcher.rollback(len(draft)):
            raise RuntimeError(f"grammar could not roll back {len(draft)} draft tokens: "
                               f"{self._matcher.get_error()}")
        return torch.stack(rows)

    def _settle(self) -> None:
        if self._pending is not None:  # the matcher is not to be used while it computes
            self._pending.result()
            self._pending = None

    def consume(self, token_id: int) -> None:
        """The token was taken (always one the mask allowed)."""
        self._settle()
        if not self._matcher.consume_token(token_id):
            raise RuntimeError(f"grammar refused token {token_id}: {self._matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The output is complete: the grammar takes nothing but the end of the sequence."""
        return bool(self._matcher.is_stopped())


class _Vocabulary:
    """What llguidance.TokenizerWrapper reads from a tokenizer: every token's bytes."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos: list[int]) -> None:
        self.eos_token_id = eos[0] if eos else None
        self.bos_token_id = None
        self.tokens = [tokenizer.token_bytes(i) for i in range(vocab_size)]
        self.special_token_ids: list[int] = list(eos)
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text)
