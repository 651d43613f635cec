"""gpt-oss's harmony answers split at the gateway: the analysis channel is the reasoning, the
final channel (and a commentary preamble) the answer, a message to functions.NAME a tool call;
the same whole or streamed in any pieces."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.harmony import HarmonyParser

ANSWER = ("<|channel|>analysis<|message|>User wants weather. Call the tool.<|end|>"
          "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
          '<|message|>{"city": "Paris", "days": 2}')  # the stop token <|call|> is not text
FINAL = ("<|channel|>analysis<|message|>Easy: 2 + 3 = 5.<|end|>"
         "<|start|>assistant<|channel|>final<|message|>It is 5.")


def whole(text: str, names=("get_weather",)) -> tuple[str, str, list]:
    parser = HarmonyParser(names)
    content, _ = parser.feed(text)
    content += parser.finish()
    return content, parser.take_reasoning(), [(c.name, json.loads(c.arguments))
                                              for c in parser.calls]


def test_channels_become_reasoning_answer_and_calls():
    assert whole(FINAL) == ("It is 5.", "Easy: 2 + 3 = 5.", [])
    assert whole(ANSWER) == ("", "User wants weather. Call the tool.",
                             [("get_weather", {"city": "Paris", "days": 2})])
    preamble = ("<|channel|>commentary<|message|>Checking the weather.<|end|><|start|>assistant"
                + ANSWER[ANSWER.index("<|channel|>commentary to"):])
    assert whole(preamble) == ("Checking the weather.", "",
                               [("get_weather", {"city": "Paris", "days": 2})])
    # a call to a function the request did not offer, or a body that is not JSON, is said
    assert whole(ANSWER, names=("add",))[0] == '{"city": "Paris", "days": 2}'
    broken = ANSWER.replace('{"city": "Paris", "days": 2}', "not json")
    assert whole(broken)[0] == "not json" and whole(broken)[2] == []
    # the recipient in the role part (harmony allows it there too)
    moved = ("<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
             '{"city": "Oslo"}')
    assert whole(moved)[2] == [("get_weather", {"city": "Oslo"})]
    assert whole("no channels at all<|end|>") == ("no channels at all", "", [])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 9), max_size=60), st.booleans())
def test_streamed_in_any_pieces_it_is_the_same_as_whole(cuts, call):
    text = ANSWER if call else FINAL
    parser = HarmonyParser(("get_weather",))
    content, reasoning, calls, at = [], [], [], 0
    for cut in [*cuts, len(text)]:
        said, closed = parser.feed(text[at:at + cut])
        content.append(said)
        reasoning.append(parser.take_reasoning())
        calls += closed
        at += cut
    content.append(parser.finish())
    reasoning.append(parser.take_reasoning())
    want_content, want_reasoning, want_calls = whole(text)
    assert "".join(content) == want_content and "".join(reasoning) == want_reasoning
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == want_calls
