"""Constrained decoding in the engine: grammars compiled or refused with the reason, masks that
hold the model to them, a constrained request batched with unconstrained ones changing nothing
of theirs, and the grammar's completion ending the request."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch

from services.engine.core import Engine
from services.engine.grammar import GrammarError, Grammars, OutputConstraint, compile_grammar
from services.engine.requests import (
    Delta,
    EngineRequest,
    Finished,
    GenerateParams,
    InvalidRequest,
)
from services.engine.runner import ModelRunner
from services.engine.sampling import SamplingConfig
from services.models import default_model_dir

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine():
    runner = ModelRunner(default_model_dir(), cache_slots=512, reserved_bytes=0)
    runner.fill_cache(runner.layer_order_pairs())
    eng = Engine(runner)
    eng.start()
    yield eng
    eng.stop()


def submit(engine: Engine, prompt: str | None, constraint: OutputConstraint | None = None,
           messages=None, tools=None, **params) -> tuple[threading.Event, list]:
    done, events = threading.Event(), []

    def sink(event):
        events.append(event)
        if isinstance(event, Finished):
            done.set()
    sampling = SamplingConfig(temperature=params.pop("temperature", 0.0),
                              seed=params.pop("seed", None),
                              logit_bias=params.pop("logit_bias", ()))
    engine.submit(EngineRequest("r", GenerateParams(sampling=sampling, constraint=constraint,
                                                    **params), prompt=prompt,
                                messages=messages, tools=tools), sink)
    return done, events


def chat(engine, messages, constraint=None, tools=None, **params) -> tuple[list, str]:
    """A chat request's events and text."""
    done, events = submit(engine, None, constraint, messages, tools, **params)
    text, _, _ = result(done, events)
    return events, text


def result(done: threading.Event, events: list) -> tuple[str, str, int]:
    assert done.wait(120)
    finished = events[-1]
    text = "".join(e.text for e in events if isinstance(e, Delta))
    return text, finished.reason, finished.stats.completion_tokens


def generate(engine, prompt, constraint=None, **params) -> tuple[str, str, int]:
    return result(*submit(engine, prompt, constraint, **params))


@pytest.mark.parametrize(("kind", "text", "says"), [
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", json.dumps({"type": "strin"}), "strin"),
    ("regex", "[a-", "regex"),
    ("lark", "start: missing_rule", "missing_rule"),
])
def test_a_constraint_that_does_not_compile_says_why(kind, text, says):
    with pytest.raises(GrammarError) as caught:
        compile_grammar(kind, text)
    assert says in str(caught.value), caught.value


@pytest.mark.parametrize("overlap", [False, True], ids=["in-sampler", "worker-thread"])
def test_the_mask_allows_exactly_what_the_grammar_takes_next(overlap):
    from services.engine.model.tokenizer import Tokenizer

    tokenizer = Tokenizer(default_model_dir())
    guide = Grammars(tokenizer, tokenizer.vocab_size, default_model_dir(),
                     overlap=overlap).guide(OutputConstraint("regex", "ab[0-9]"))
    guide.start_mask()  # what the engine does before the forward
    first = guide.allowed()
    assert first.dtype == torch.bool and first.shape == (tokenizer.vocab_size,)
    texts = {tokenizer.decode([int(i)]) for i in first.nonzero().flatten()}
    assert texts and all("ab"[:len(t)] == t or t.startswith("ab") for t in texts), texts
    (a,) = tokenizer.encode("a")
    guide.start_mask()  # a mask begun and not used: consume waits for it, then moves on
    guide.consume(a)
    guide.start_mask()
    after_a = {tokenizer.decode([int(i)]) for i in guide.allowed().nonzero().flatten()}
    assert "b" in after_a and "a" not in after_a
    guide.consume(tokenizer.encode("b")[0])
    digits = {tokenizer.decode([int(i)]) for i in guide.allowed().nonzero().flatten()}
    assert digits == {str(d) for d in range(10)}
    assert not guide.done
    guide.consume(tokenizer.encode("7")[0])
    assert guide.done


def test_json_schema_output_validates_greedy_and_sampled(engine):
    for seed in (None, 1, 2, 3):
        text, reason, _ = generate(engine, "def parse(x):", OutputConstraint(
            "json_schema", json.dumps(SCHEMA)), max_tokens=120,
            temperature=0.0 if seed is None else 1.0, seed=seed)
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


def test_the_grammar_wins_over_logit_bias_and_its_completion_ends_the_request(engine):
    from services.engine.model.tokenizer import Tokenizer

    (x_id,) = Tokenizer(default_model_dir()).encode("x")
    text, reason, tokens = generate(engine, "def f", OutputConstraint("regex", "[0-9]{4}"),
                                    max_tokens=50, logit_bias=((x_id, 100.0),),
                                    ignore_eos=True)
    assert re.fullmatch("[0-9]{4}", text) and reason == "stop" and tokens <= 4, text


def test_max_tokens_before_the_grammar_completes_is_length_not_stop(engine):
    text, reason, tokens = generate(engine, "def f", OutputConstraint(
        "json_schema", json.dumps(SCHEMA)), max_tokens=5)
    assert reason == "length" and tokens == 5
    with pytest.raises(ValueError):
        json.loads(text)  # cut short: never reported as complete


def test_constrained_and_plain_requests_share_a_batch_without_changing_each_other(engine):
    plain_alone = generate(engine, "import os\n", max_tokens=24, ignore_eos=True)
    guided_alone = generate(engine, "x = ", OutputConstraint("json_object"), max_tokens=60)
    running = [submit(engine, "import os\n", max_tokens=24, ignore_eos=True),
               submit(engine, "x = ", OutputConstraint("json_object"), max_tokens=60),
               submit(engine, "import os\n", max_tokens=24, ignore_eos=True)]
    plain_1, guided, plain_2 = (result(*r) for r in running)
    assert plain_1 == plain_2 == plain_alone  # greedy: the same whatever shares the batch
    assert guided == guided_alone
    if guided[1] == "stop":
        assert isinstance(json.loads(guided[0]), dict)


def test_a_constraint_that_does_not_compile_is_refused_at_submit(engine):
    with pytest.raises(InvalidRequest) as caught:
        submit(engine, "x", OutputConstraint("json_schema", json.dumps({"type": "integr"})))
    assert "integr" in str(caught.value)
    assert engine.num_running == 0


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
    "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "ping"}}]  # no parameters: an empty list


@pytest.mark.parametrize("choice", ["required", "get_weather", "ping"])
def test_a_required_or_named_tool_choice_is_one_valid_call_block(engine, choice):
    from services.engine.requests import ToolSpec

    done, events = threading.Event(), []

    def sink(event):
        events.append(event)
        if isinstance(event, Finished):
            done.set()
    engine.submit(EngineRequest("t", GenerateParams(max_tokens=80, sampling=SamplingConfig(
        temperature=1.0, seed=4)), messages=(("user", "weather?"),),
        tools=ToolSpec(json.dumps(TOOLS), choice, parallel=False)), sink)
    text, reason, _ = result(done, events)
    assert events[0].tool_call_format == "hermes" and reason == "stop", text
    match = re.fullmatch(r"<tool_call>\n(.*)\n</tool_call>", text, re.S)
    call = json.loads(match.group(1))
    assert choice == "required" or call["name"] == choice
    schema = {t["function"]["name"]: t["function"].get("parameters") for t in TOOLS}
    if schema[call["name"]] is None:
        assert call["arguments"] == {}
    else:
        jsonschema.validate(call["arguments"], schema[call["name"]])


def test_speculative_drafts_are_cut_to_the_grammar_and_change_nothing(engine):
    """n-gram drafts under a JSON schema: cut where the grammar would not take them, verified
    with each row's own mask; greedy output identical to the engine without drafts."""
    from services.engine.spec.ngram import NgramDraft

    runner = ModelRunner(default_model_dir(), cache_slots=512, reserved_bytes=0)
    runner.fill_cache(runner.layer_order_pairs())
    schema = {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                 "maxItems": 12}}, "required": ["tags"], "additionalProperties": False}
    constraint = OutputConstraint("json_schema", json.dumps(schema))
    plain = [generate(engine, p, constraint, max_tokens=80)
             for p in ("colors:", "def f(x):", "tags = ")]
    spec = Engine(runner, draft_source=NgramDraft(), spec_tokens=4)
    spec.start()
    try:
        drafted = []
        for p in ("colors:", "def f(x):", "tags = "):
            done, events = submit(spec, p, constraint, max_tokens=80)
            drafted.append(result(done, events))
        proposed = spec.totals.drafts_proposed
    finally:
        spec.stop()
    assert drafted == plain
    assert proposed > 0, "no draft was proposed: the test did not exercise verification"
    for text, reason, _ in drafted:
        if reason == "stop":
            jsonschema.validate(json.loads(text), schema)


@pytest.fixture(scope="module")
def syntax_engines(tmp_path_factory):
    """An engine per tool-call syntax, made when first asked for: the default model behind
    GLM-4.5's or DeepSeek's template; a tiny random model with Kimi's special tokens."""
    from tests.engine import conftest

    makers = {"glm45": lambda p: conftest.glm45_model_dir(p),
              "qwen3_xml": lambda p: conftest.templated_model_dir(p,
                                                                  conftest.QWEN3_XML_TEMPLATE),
              "minimax_m2": lambda p: conftest.templated_model_dir(p,
                                                                   conftest.MINIMAX_TEMPLATE),
              "deepseek_v3": lambda p: conftest.templated_model_dir(p, conftest.DS_V3_TEMPLATE),
              "deepseek_v31": lambda p: conftest.templated_model_dir(p,
                                                                     conftest.DS_V31_TEMPLATE),
              "kimi_k2": lambda p: conftest.kimi_model_dir(p)}
    engines: dict[str, Engine] = {}

    def get(fmt: str) -> Engine:
        if fmt not in engines:
            model = makers[fmt](tmp_path_factory.mktemp(fmt) / fmt)
            engines[fmt] = Engine(ModelRunner(model, cache_slots=10**9, reserved_bytes=0))
            engines[fmt].start()
        return engines[fmt]
    yield get
    for engine in engines.values():
        engine.stop()


GLM_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "ping"}}]


@pytest.mark.parametrize(("fmt", "choice", "seed"), [
    ("glm45", "required", 1), ("glm45", "required", 7), ("glm45", "get_weather", 3),
    ("glm45", "ping", 4), ("qwen3_xml", "required", 1), ("qwen3_xml", "get_weather", 2),
    ("qwen3_xml", "ping", 3), ("minimax_m2", "required", 1), ("minimax_m2", "get_weather", 2),
    ("deepseek_v3", "required", 1), ("deepseek_v3", "get_weather", 2),
    ("deepseek_v31", "required", 3), ("deepseek_v31", "ping", 4), ("kimi_k2", "required", 5),
    ("kimi_k2", "get_weather", 6)])
def test_a_required_call_is_written_in_the_template_s_own_syntax(syntax_engines, fmt, choice,
                                                                  seed):
    """Each template's syntax: the required / named call is written as that family writes
    calls, parses, and its arguments validate; the history's calls reach the template as it
    takes them (GLM's iterates the arguments as an object; Kimi's replays the call ids)."""
    from services.engine.requests import ChatTurn, ToolSpec
    from services.gateway.tools import ToolCallParser

    history = (ChatTurn("user", "weather in Oslo?"),
               ChatTurn("assistant", "", (("functions.get_weather:0", "get_weather",
                                            json.dumps({"city": "Oslo", "days": 2})),)),
               ChatTurn("tool", "sunny", tool_call_id="functions.get_weather:0"),
               ChatTurn("user", "and Paris?"))
    events, text = chat(syntax_engines(fmt), history,
                        tools=ToolSpec(json.dumps(GLM_TOOLS), choice, parallel=False),
                        max_tokens=160, temperature=1.0, seed=seed)
    assert events[0].tool_call_format == fmt and events[-1].reason == "stop", text
    parser = ToolCallParser(fmt, ("get_weather", "ping"),
                            {t["function"]["name"]: t["function"].get("parameters") or {}
                             for t in GLM_TOOLS})
    content, calls = parser.feed(text)
    assert content == "" and parser.finish() == "" and len(calls) == 1, text
    call = calls[0]
    assert choice == "required" or call.name == choice
    schema = {t["function"]["name"]: t["function"].get("parameters") for t in GLM_TOOLS}
    arguments = json.loads(call.arguments)
    if schema[call.name] is None:
        assert arguments == {}
    else:
        jsonschema.validate(arguments, schema[call.name])


@pytest.fixture(scope="module")
def harmony_engine(tmp_path_factory):
    from tests.engine.conftest import harmony_model_dir

    runner = ModelRunner(harmony_model_dir(tmp_path_factory.mktemp("harmony") / "gpt-oss"),
                         cache_slots=10**9, reserved_bytes=0)
    eng = Engine(runner)
    eng.start()
    yield eng
    eng.stop()


def test_a_harmony_chat_answer_keeps_its_channel_tokens_for_the_gateway(harmony_engine):
    """gpt-oss's harmony: a chat answer's text keeps the special tokens that mark its
    messages (the gateway splits reasoning from answer by them), said so in Started; a raw
    completion's text does not."""
    from services.gateway.harmony import HarmonyParser

    shaped = OutputConstraint("lark", 'start: <|channel|> "analysis" <|message|> /[a-z]{1,8}/ '
                              '<|end|> <|start|> "assistant" <|channel|> "final" <|message|> '
                              '/[a-z]{1,8}/\n')
    events, text = chat(harmony_engine, (("user", "hi"),), shaped, max_tokens=40)
    assert events[0].tool_call_format == "harmony"
    assert text.startswith("<|channel|>analysis<|message|>") and "<|channel|>final" in text
    parser = HarmonyParser()
    content = parser.feed(text)[0] + parser.finish()
    reasoning = parser.take_reasoning()
    assert re.fullmatch("[a-z]{1,8}", content) and re.fullmatch("[a-z]{1,8}", reasoning)
    done, raw = submit(harmony_engine, "hi", shaped, max_tokens=40)
    raw_text, _, _ = result(done, raw)
    assert raw[0].tool_call_format == "" and "<|" not in raw_text


@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_a_required_harmony_call_is_a_commentary_message_to_the_function(harmony_engine,
                                                                         choice):
    from services.engine.requests import ToolSpec
    from services.gateway.harmony import HarmonyParser

    events, text = chat(harmony_engine, (("user", "weather?"),),
                        tools=ToolSpec(json.dumps(GLM_TOOLS), choice, parallel=False),
                        max_tokens=120, temperature=1.0, seed=4)
    assert events[-1].reason == "stop", text
    parser = HarmonyParser(("get_weather", "ping"))
    parser.feed(text)
    parser.finish()
    (call,) = parser.calls
    assert choice == "required" or call.name == choice
    schema = {t["function"]["name"]: t["function"].get("parameters") for t in GLM_TOOLS}
    jsonschema.validate(json.loads(call.arguments), schema[call.name] or {})


@pytest.mark.parametrize("parallel", [False, True])
def test_parallel_tool_calls_false_ends_the_answer_at_its_first_call(engine, parallel):
    """tool_choice auto with parallel_tool_calls false: a model about to write a second call
    (held to two by a grammar here) is stopped where the first closes; with it true, both."""
    from services.engine.requests import ToolSpec

    call = '"<tool_call>\\n{\\"name\\": \\"ping\\", \\"arguments\\": {}}\\n</tool_call>"'
    two = OutputConstraint("lark", f'start: {call} "\\n" {call}\n')
    events, text = chat(engine, (("user", "ping twice"),), two,
                        ToolSpec(json.dumps(TOOLS), "auto", parallel=parallel), max_tokens=80)
    calls = text.count("</tool_call>")
    assert events[-1].reason == "stop" and calls == (2 if parallel else 1), text
    assert text.endswith("</tool_call>")


def test_tools_for_a_template_without_a_call_syntax_are_refused_naming_those_known(
        tmp_path):
    """A chat template that teaches no tool-call syntax: a request with tools is refused by
    name (the syntaxes Strata parses listed), before anything runs."""
    from services.engine.requests import ToolSpec
    from tests.engine.conftest import templated_model_dir

    plain = ("{%- for m in messages -%}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
             "{%- endfor -%}<|im_start|>assistant\n")
    runner = ModelRunner(templated_model_dir(tmp_path / "plain", plain), cache_slots=0,
                         reserved_bytes=0)
    engine = Engine(runner)
    with pytest.raises(InvalidRequest, match="teaches no tool-call syntax.*glm45.*harmony"):
        engine.submit(EngineRequest("n", GenerateParams(max_tokens=4),
                                    messages=(("user", "hi"),),
                                    tools=ToolSpec(json.dumps(TOOLS), "auto", parallel=True)),
                      lambda event: None)


def _takes(engine: Engine, constraint: OutputConstraint, text: str) -> tuple[bool, bool]:
    """Whether the grammar takes `text` (as the engine's tokenizer splits it), and whether
    the output may end there."""
    guide = engine._guide(constraint)
    for token in engine.runner.tokenizer.encode(text):
        if token not in guide.allowed().nonzero().flatten().tolist():
            return False, False
        guide.consume(token)
    return True, bool(guide.allowed()[list(engine.runner.tokenizer.eos_token_ids)].any())


STRICT_TOOLS = [{**t, "function": {**t["function"], "strict": True}} for t in GLM_TOOLS]


@pytest.mark.parametrize("fmt", ["hermes", "glm45", "qwen3_xml", "minimax_m2", "deepseek_v3",
                                 "deepseek_v31", "kimi_k2", "harmony"])
def test_a_strict_function_s_calls_are_held_under_tool_choice_auto(engine, syntax_engines,
                                                                   harmony_engine, fmt):
    """tools[].function.strict with tool_choice auto: the answer is free text, or text and
    then calls in the template's syntax whose arguments follow the parameters (the text a
    required call takes, after some words, is taken; the opening followed by anything else
    is not). Without strict, auto holds nothing."""
    from services.common.tool_calls import SECTION_MARKERS
    from services.engine.grammar import tool_call_constraint
    from services.engine.requests import ToolSpec

    eng = {"hermes": engine, "harmony": harmony_engine}.get(fmt) or syntax_engines(fmt)
    strict = ToolSpec(json.dumps(STRICT_TOOLS), "auto", parallel=False)
    auto = eng._constraint(EngineRequest("s", GenerateParams(), messages=(("user", "hi"),),
                                         tools=strict))
    assert auto == tool_call_constraint(fmt, strict.tools_json, "auto", False)
    plain = ToolSpec(json.dumps(GLM_TOOLS), "auto", parallel=False)
    assert eng._constraint(EngineRequest("p", GenerateParams(), messages=(("user", "hi"),),
                                         tools=plain)) is None
    _, call = chat(eng, (("user", "weather in Oslo?"),), max_tokens=160, temperature=1.0,
                   seed=4, tools=ToolSpec(json.dumps(STRICT_TOOLS), "get_weather",
                                          parallel=False))
    free = "Sunny, 21 C; a < b." if fmt != "harmony" else "<|channel|>final<|message|>Sunny."
    assert _takes(eng, auto, free) == (True, True)
    if fmt == "harmony":  # the answer is a message: its channel says which, from the start
        assert _takes(eng, auto, call) == (True, True), call
        assert _takes(eng, auto, "Sunny.") == (False, False)
        return
    # one call: the engine ends the answer where the call closes, before a section's end
    may_end = fmt not in SECTION_MARKERS
    assert _takes(eng, auto, "Let me look that up.\n" + call) == (True, may_end), call
    opening = {"hermes": "<tool_call>", "glm45": "<tool_call>", "qwen3_xml": "<tool_call>",
               "minimax_m2": "<minimax:tool_call>", "deepseek_v3": "<｜tool▁calls▁begin｜>",
               "deepseek_v31": "<｜tool▁calls▁begin｜>",
               "kimi_k2": "<|tool_calls_section_begin|>"}[fmt]
    assert call.startswith(opening)
    assert _takes(eng, auto, "Let me look that up.\n" + opening + " whatever I like")[0] is False


@pytest.mark.parametrize("fmt", ["hermes", "glm45", "kimi_k2", "harmony"])
def test_a_json_answer_with_tools_is_the_json_or_the_calls(engine, syntax_engines,
                                                          harmony_engine, fmt):
    """response_format JSON with tools (choice auto): the answer is the JSON (in harmony, as
    the final message) or the calls, held to their parameters, not text of any other form;
    a strict function with a regex is a 400 naming both."""
    from services.engine.requests import ToolSpec

    eng = {"hermes": engine, "harmony": harmony_engine}.get(fmt) or syntax_engines(fmt)
    tools = ToolSpec(json.dumps(GLM_TOOLS), "auto", parallel=False)
    json_object = OutputConstraint("json_object")
    held = eng._constraint(EngineRequest("j", GenerateParams(constraint=json_object),
                                         messages=(("user", "hi"),), tools=tools))
    _, call = chat(eng, (("user", "weather in Oslo?"),), max_tokens=160, temperature=1.0,
                   seed=3, tools=ToolSpec(json.dumps(GLM_TOOLS), "get_weather", parallel=False))
    final = "<|channel|>final<|message|>" if fmt == "harmony" else ""
    assert _takes(eng, held, final + '{"city": "Oslo"}') == (True, True)
    assert _takes(eng, held, final + "Sunny.")[0] is False
    assert _takes(eng, held, call)[0] is True, call
    strict = ToolSpec(json.dumps(STRICT_TOOLS), "auto", parallel=False)
    with pytest.raises(InvalidRequest, match="strict.*regex or grammar"):
        eng._constraint(EngineRequest("r", GenerateParams(constraint=OutputConstraint(
            "regex", "[a-z]+")), messages=(("user", "hi"),), tools=strict))


def test_a_harmony_json_answer_is_the_final_message(harmony_engine):
    """gpt-oss with response_format JSON and no tools: it may reason first (analysis), and its
    final message's content is the JSON; a raw completion is held to the JSON as written."""
    from services.gateway.harmony import HarmonyParser

    (end,) = harmony_engine.runner.tokenizer.encode("<|end|>")  # a random model's reasoning
    for seed in (1, 2, 3):                                       # would not end by itself
        events, text = chat(harmony_engine, (("user", "hi"),), OutputConstraint("json_object"),
                            max_tokens=200, temperature=1.0, seed=seed,
                            logit_bias=((end, 8.0),))
        assert text.startswith("<|channel|>") and "<|channel|>final<|message|>{" in text, text
        parser = HarmonyParser()
        content = parser.feed(text)[0] + parser.finish()
        if events[-1].reason == "stop":
            assert isinstance(json.loads(content), dict), content
    raw_text, _, _ = result(*submit(harmony_engine, "hi", OutputConstraint("json_object"),
                                    max_tokens=60))
    assert raw_text.startswith("{"), raw_text


@pytest.mark.parametrize("mode", ["required", "auto"])
def test_allowed_tools_hold_the_calls_to_those_functions_and_render_every_tool(engine, mode):
    """OpenAI's allowed_tools: the prompt renders every tool (it stays the same whichever are
    allowed), and the output may call only the allowed ones: a required call is one of them,
    and under auto a call to another does not pass the grammar."""
    from services.engine.grammar import tool_call_constraint
    from services.engine.requests import ToolSpec

    everything = ToolSpec(json.dumps(TOOLS), mode, parallel=False)
    allowed = ToolSpec(json.dumps(TOOLS), mode, parallel=False, allowed=("ping",))
    request = EngineRequest("a", GenerateParams(), messages=(("user", "weather?"),),
                            tools=allowed)
    assert engine._constraint(request) == tool_call_constraint(
        "hermes", json.dumps([TOOLS[1]]), mode, False)
    assert engine.prompt_ids(request) == engine.prompt_ids(EngineRequest(
        "b", GenerateParams(), messages=(("user", "weather?"),), tools=everything))
    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    ping = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    constraint = engine._constraint(request)
    assert _takes(engine, constraint, ping)[0] is True
    assert _takes(engine, constraint, weather)[0] is False
    if mode == "required":
        for seed in range(3):
            _, text = chat(engine, (("user", "weather in Oslo?"),), max_tokens=80,
                           temperature=1.0, seed=seed, tools=allowed)
            assert json.loads(re.fullmatch(r"<tool_call>\n(.*)\n</tool_call>", text,
                                           re.S).group(1))["name"] == "ping"
    with pytest.raises(InvalidRequest, match="'nope'"):
        engine._constraint(EngineRequest("c", GenerateParams(), messages=(("user", "hi"),),
                                         tools=ToolSpec(json.dumps(TOOLS), mode,
                                                        allowed=("nope",))))
