"""Tool calling at the gateway: tools and tool_choice validated by name, and tool calls parsed
out of the model's text the same way whole or streamed in any pieces."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.errors import InvalidRequest
from services.gateway.schemas import parse_chat
from services.gateway.tools import ToolCallParser, parse_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "description": "a + b"}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
MESSAGES = [{"role": "user", "content": "weather?"}]


def test_tool_choice_forms():
    tools = parse_tools({"tools": [WEATHER, ADD]})
    assert (tools.choice, tools.parallel, tools.names) == ("auto", True, ("get_weather", "add"))
    assert json.loads(tools.tools_json) == [WEATHER, ADD]
    assert parse_tools({"tools": [WEATHER], "tool_choice": "required"}).choice == "required"
    named = parse_tools({"tools": [WEATHER, ADD], "parallel_tool_calls": False,
                         "tool_choice": {"type": "function", "function": {"name": "add"}}})
    assert (named.choice, named.parallel) == ("add", False)
    assert parse_tools({"tools": [WEATHER], "tool_choice": "none"}) is None
    assert parse_tools({}) is None
    allowed = parse_tools({"tools": [WEATHER, ADD], "tool_choice": {
        "type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
            {"type": "function", "function": {"name": "add"}}]}}})
    assert (allowed.choice, allowed.allowed, allowed.names) == (
        "required", ("add",), ("get_weather", "add"))
    assert json.loads(allowed.tools_json) == [WEATHER, ADD]  # every tool still in the prompt


@pytest.mark.parametrize(("body", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": []}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "add"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "function", "function": {"name": "add"}}]}}},
     "tool_choice.allowed_tools.tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "sometimes", "tools": [{"type": "function", "function": {"name": "add"}}]}}},
     "tool_choice.allowed_tools.mode"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": []}}}, "tool_choice.allowed_tools.tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [WEATHER], "extra": 1}}}, "tool_choice.allowed_tools.extra"),
    ({"functions": [ADD["function"]]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
])
def test_bad_tool_fields_are_refused_by_name(body, param):
    with pytest.raises(InvalidRequest) as caught:
        parse_chat({"model": "m", "messages": MESSAGES, **body})
    assert caught.value.param == param and caught.value.status == 400


def test_a_history_with_calls_and_their_results_is_taken():
    spec = parse_chat({"model": "m", "tools": [WEATHER], "messages": [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]})
    assistant, tool = spec.messages[1], spec.messages[2]
    assert assistant.tool_calls[0].name == "get_weather" and assistant.content == ""
    # calls rebuilt from a stream's deltas keep their index: their place in tool_calls
    rebuilt = parse_chat({"model": "m", "tools": [WEATHER], "messages": [
        *MESSAGES, {"role": "assistant", "content": None, "tool_calls": [{
            "index": i, "id": f"call_{i}", "type": "function",
            "function": {"name": "get_weather", "arguments": "{}"}} for i in (0, 1)]}]})
    assert [c.id for c in rebuilt.messages[1].tool_calls] == ["call_0", "call_1"]
    assert (tool.role, tool.tool_call_id, tool.content) == ("tool", "call_1", "sunny, 21 C")
    for bad, param in [({"role": "tool", "content": "x"}, "messages[1].tool_call_id"),
                       ({"role": "user", "content": "x", "tool_calls": []},
                        "messages[1].tool_calls"),
                       ({"role": "assistant", "tool_calls": [{"id": "c", "function": {
                           "name": "f", "arguments": "{oops"}}]},
                        "messages[1].tool_calls[0].function.arguments")]:
        with pytest.raises(InvalidRequest) as caught:
            parse_chat({"model": "m", "messages": [*MESSAGES, bad]})
        assert caught.value.param == param


def whole(text: str, names=("get_weather", "add")) -> tuple[str, list]:
    parser = ToolCallParser("hermes", names)
    content, _ = parser.feed(text)
    return content + parser.finish(), [(c.name, json.loads(c.arguments)) for c in parser.calls]


def test_calls_are_parsed_out_and_the_rest_is_content():
    assert whole(CALL) == ("", [("get_weather", {"city": "Paris"})])
    two = CALL + "\n" + '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert whole(two)[1] == [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    assert whole("Let me look.\n" + CALL + "\n") == (
        "Let me look.", [("get_weather", {"city": "Paris"})])
    assert whole("no calls here") == ("no calls here", [])
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert whole(broken) == (broken, [])  # a block that does not parse stays text
    unknown = CALL.replace("get_weather", "rm_rf")
    assert whole(unknown) == (unknown, [])  # a function the request did not offer
    assert whole("a <tool_call> never closed") == ("a <tool_call> never closed", [])
    assert whole("x < y and <tool") == ("x < y and <tool", [])


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["", "Sure. ", "  \n", "text <b>bold</b> "]),
       st.sampled_from(["", "\n", " done"]), st.lists(st.integers(1, 12), max_size=40),
       st.booleans())
def test_streamed_in_any_pieces_it_is_the_same_as_whole(before, after, cuts, two):
    text = before + CALL + ("\n" + CALL if two else "") + after
    parser = ToolCallParser("hermes", ("get_weather",))
    content, calls, at = [], [], 0
    for cut in cuts:
        piece, at = text[at:at + cut], at + cut
        said, closed = parser.feed(piece)
        content.append(said)
        calls += closed
    said, closed = parser.feed(text[at:])
    content.append(said)
    calls += closed
    content.append(parser.finish())
    expected_content, expected_calls = whole(text, ("get_weather",))
    assert "".join(content) == expected_content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected_calls
    assert len({c.id for c in calls}) == len(calls)


# -- GLM-4.5's syntax (glm45): <tool_call>NAME then <arg_key>/<arg_value> lines -------------------
GLM_PARAMETERS = {"get_weather": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "opts": {"type": "object"},
    "code": {"type": "string"}}}}
GLM_CALL = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>opts</arg_key>\n"
            '<arg_value>{"metric": true}</arg_value>\n<arg_key>code</arg_key>\n'
            "<arg_value>42</arg_value>\n</tool_call>")


def glm_whole(text: str) -> tuple[str, list]:
    parser = ToolCallParser("glm45", ("get_weather", "add"), GLM_PARAMETERS)
    content, _ = parser.feed(text)
    return content + parser.finish(), [(c.name, json.loads(c.arguments)) for c in parser.calls]


def test_glm45_calls_take_their_types_from_the_parameters():
    """A string parameter keeps its text as written (GLM's template writes strings raw: "42"
    stays a string), any other is JSON; no arguments is {}; a stray line, an unknown function
    or an unclosed block stays content."""
    want = {"city": "Paris", "days": 3, "opts": {"metric": True}, "code": "42"}
    assert glm_whole(GLM_CALL) == ("", [("get_weather", want)])
    assert glm_whole("Checking.\n" + GLM_CALL + "\n<tool_call>add\n</tool_call>") == (
        "Checking.", [("get_weather", want), ("add", {})])
    stray = GLM_CALL.replace("<arg_key>days", "oops\n<arg_key>days")
    assert glm_whole(stray) == (stray, [])
    unknown = GLM_CALL.replace("get_weather", "rm_rf")
    assert glm_whole(unknown) == (unknown, [])
    assert glm_whole("<tool_call>add\n<arg_key>a") == ("<tool_call>add\n<arg_key>a", [])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 9), max_size=40))
def test_glm45_streamed_in_any_pieces_is_the_same_as_whole(cuts):
    text = "Sure. " + GLM_CALL + "\n" + GLM_CALL
    parser = ToolCallParser("glm45", ("get_weather",), GLM_PARAMETERS)
    calls, at = [], 0
    for cut in [*cuts, len(text)]:
        calls += parser.feed(text[at:at + cut])[1]
        at += cut
    parser.finish()
    assert [(c.name, json.loads(c.arguments)) for c in calls] == glm_whole(text)[1]


def test_qwen3_xml_calls_take_their_types_from_the_parameters():
    """Qwen3.5's <function=NAME> / <parameter=K> blocks: typed as glm45's values are."""
    call = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=opts>\n{\"metric\": true}\n"
            "</parameter>\n<parameter=code>\n42\n</parameter>\n</function>\n</tool_call>")
    parser = ToolCallParser("qwen3_xml", ("get_weather",), GLM_PARAMETERS)
    content, _ = parser.feed("Checking. " + call)
    assert content + parser.finish() == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [
        ("get_weather", {"city": "Paris", "days": 3, "opts": {"metric": True}, "code": "42"})]
    parser = ToolCallParser("qwen3_xml", ("get_weather",), GLM_PARAMETERS)
    stray = call.replace("<parameter=days>", "junk\n<parameter=days>")
    assert parser.feed(stray)[0] + parser.finish() == stray and not parser.calls


def test_the_template_says_which_syntax():
    from services.common.tool_calls import template_tool_call_format
    from tests.engine.conftest import GLM45_TEMPLATE, QWEN3_XML_TEMPLATE

    assert template_tool_call_format(GLM45_TEMPLATE) == "glm45"
    assert template_tool_call_format(QWEN3_XML_TEMPLATE) == "qwen3_xml"
    assert template_tool_call_format('{{ "<tool_call>\\n" + call | tojson }}') == "hermes"
    assert template_tool_call_format("{{ messages }}") == ""


# -- DeepSeek's and Kimi's: calls between their markers, a section around a turn's calls -------
DS_V3_CALL = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
              '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function'
              '<｜tool▁sep｜>add\n```json\n{"a": 1}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
DS_V31_CALL = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
               '<｜tool▁call▁end｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{"a": 1}<｜tool▁call▁end｜>'
               "<｜tool▁calls▁end｜>")
KIMI_CALL = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
             '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>'
             'functions.add:1<|tool_call_argument_begin|>{"a": 1}<|tool_call_end|>'
             "<|tool_calls_section_end|>")
MINIMAX_CALL = ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'
                '</parameter>\n</invoke>\n<invoke name="add">\n<parameter name="a">1</parameter>'
                "\n</invoke>\n</minimax:tool_call>")
MARKED = {"deepseek_v3": DS_V3_CALL, "deepseek_v31": DS_V31_CALL, "kimi_k2": KIMI_CALL,
          "minimax_m2": MINIMAX_CALL}


def marked_whole(fmt: str, text: str) -> tuple[str, list]:
    parser = ToolCallParser(fmt, ("get_weather", "add"))
    content, _ = parser.feed(text)
    return content + parser.finish(), [(c.id, c.name, json.loads(c.arguments))
                                       for c in parser.calls]


@pytest.mark.parametrize("fmt", list(MARKED))
def test_deepseek_and_kimi_calls_are_parsed_and_their_sections_are_not_content(fmt):
    content, calls = marked_whole(fmt, "Let me check. " + MARKED[fmt])
    assert content == "Let me check."
    assert [(name, args) for _, name, args in calls] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 1})]
    if fmt == "kimi_k2":  # Kimi's ids name the call (its template replays them)
        assert [i for i, _, _ in calls] == ["functions.get_weather:0", "functions.add:1"]
    unknown = MARKED[fmt].replace("get_weather", "rm_rf")
    assert len(marked_whole(fmt, unknown)[1]) == 1  # the call to a function not offered: text


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(list(MARKED)), st.lists(st.integers(1, 7), max_size=50))
def test_deepseek_and_kimi_streamed_in_any_pieces_are_the_same_as_whole(fmt, cuts):
    text = "Sure. " + MARKED[fmt]
    parser = ToolCallParser(fmt, ("get_weather", "add"))
    content, at = [], 0
    for cut in [*cuts, len(text)]:
        content.append(parser.feed(text[at:at + cut])[0])
        at += cut
    content.append(parser.finish())
    want_content, want_calls = marked_whole(fmt, text)
    assert "".join(content) == want_content
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [
        (n, a) for _, n, a in want_calls]


def test_deepseek_and_kimi_templates_say_their_syntax():
    from services.common.tool_calls import template_tool_call_format
    from tests.engine.conftest import (
        DS_V3_TEMPLATE,
        DS_V31_TEMPLATE,
        KIMI_TEMPLATE,
        MINIMAX_TEMPLATE,
    )

    assert [template_tool_call_format(t) for t in (DS_V3_TEMPLATE, DS_V31_TEMPLATE,
                                                   KIMI_TEMPLATE, MINIMAX_TEMPLATE)] == [
        "deepseek_v3", "deepseek_v31", "kimi_k2", "minimax_m2"]
