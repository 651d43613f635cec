"""Request parsing into native types (no HTTP)."""

import json

import pytest

from services.gateway.errors import InvalidRequest
from services.gateway.schemas import Constraint, Message, Sampling, parse_chat, parse_completion

MESSAGES = [{"role": "user", "content": "hi"}]


def test_chat_defaults():
    spec = parse_chat({"model": "m", "messages": MESSAGES})
    assert spec.is_chat and spec.messages == (Message("user", "hi"),)
    assert spec.sampling == Sampling(temperature=1.0, top_p=1.0, top_k=0, seed=None,
                                     max_tokens=0, stop=())
    assert (spec.stream, spec.include_usage) == (False, False)


def test_chat_parameters():
    spec = parse_chat({
        "model": "m", "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "developer", "content": "rules"},
                     {"role": "assistant", "content": None},
                     {"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}]}],
        "max_tokens": 7, "max_completion_tokens": 7, "temperature": 0, "top_p": 0.9,
        "top_k": -1, "seed": 3, "stop": "END", "n": 1, "response_format": {"type": "text"},
        "user": "u-1"})
    assert spec.messages == (Message("system", "rules"), Message("assistant", ""),
                             Message("user", "ab"))
    assert spec.sampling == Sampling(temperature=0.0, top_p=0.9, top_k=0, seed=3, max_tokens=7,
                                     stop=("END",))
    assert (spec.stream, spec.include_usage, spec.user) == (True, True, "u-1")


def test_a_field_the_parser_does_not_read_is_refused_by_name():
    """OpenAI answers an unrecognized argument with a 400 too; nothing is silently ignored."""
    for parse, base in ((parse_chat, {"model": "m", "messages": MESSAGES}),
                        (parse_completion, {"model": "m", "prompt": "hi"})):
        with pytest.raises(InvalidRequest) as info:
            parse({**base, "some_future_field": {"ignored": True}})
        assert (info.value.param, info.value.code) == ("some_future_field",
                                                       "unsupported_parameter")
        assert "not a field of" in info.value.message
    with pytest.raises(InvalidRequest, match="a /v1/chat/completions field"):
        parse_completion({"model": "m", "prompt": "hi", "max_completion_tokens": 3})
    # a null asks for nothing (clients that send every parameter, unset ones as null)
    assert parse_chat({"model": "m", "messages": MESSAGES, "store": None, "metadata": None,
                       "prompt": None}).model == "m"


def test_stream_options_need_stream():
    with pytest.raises(InvalidRequest) as info:  # OpenAI answers 400 too
        parse_chat({"model": "m", "messages": MESSAGES, "stream_options": {"include_usage": True}})
    assert info.value.param == "stream_options"
    assert not parse_chat({"model": "m", "messages": MESSAGES, "stream": False}).include_usage


def test_completion_prompt_forms():
    spec = parse_completion({"model": "m", "prompt": ["once"]})
    assert spec.prompt == "once" and not spec.is_chat
    for prompt, prompts in (("once", ("once",)), ([5, 0, 7], ((5, 0, 7),)),
                            (["a", "b"], ("a", "b")), ([[1], [2, 3]], ((1,), (2, 3))),
                            (["a", [4]], ("a", (4,)))):
        spec = parse_completion({"model": "m", "prompt": prompt, "n": 2})
        assert (spec.prompts, spec.num_choices) == (prompts, 2 * len(prompts))
    assert spec.sampling.max_tokens == 16  # OpenAI's default for completions
    assert parse_completion({"model": "m", "prompt": "x", "max_tokens": 3}).sampling.max_tokens == 3


@pytest.mark.parametrize(("patch", "param"), [
    ({"max_tokens": True}, "max_tokens"),
    ({"seed": 2**64}, "seed"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"temperature": float("nan")}, "temperature"),
    ({"n": 1.0}, "n"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": []}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 5}}]},
     "tools[0].function.description"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": 1}}]},
     "tools[0].function.strict"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a" * 70000}, "guided_regex"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"prompt": "once"}, "prompt"),  # a completions field (the fuzz test's find)
    ({"stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
])
def test_chat_rejections_name_the_parameter(patch, param):
    with pytest.raises(InvalidRequest) as info:
        parse_chat({"model": "m", "messages": MESSAGES, **patch})
    assert info.value.param == param and info.value.status == 400


def test_output_constraints_become_the_engines_on_both_endpoints():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}
    for parse, base in ((parse_chat, {"model": "m", "messages": MESSAGES}),
                        (parse_completion, {"model": "m", "prompt": "x"})):
        assert parse({**base, "response_format": {"type": "json_object"}}).constraint == \
            Constraint("json_object")
        assert parse({**base, "response_format": fmt}).constraint == \
            Constraint("json_schema", json.dumps(schema))
        assert parse({**base, "response_format": {"type": "text"}}).constraint is None
        assert parse({**base, "guided_regex": "a+"}).constraint == Constraint("regex", "a+")
        assert parse({**base, "guided_choice": ["yes", "no"]}).constraint == \
            Constraint("lark", 'start: "yes" | "no"')
        assert parse({**base, "guided_json": json.dumps(schema)}).constraint == \
            Constraint("json_schema", json.dumps(schema))
