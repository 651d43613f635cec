"""/openapi.json: served, well formed, covers every route, and tells the truth about the bounds:
a value at a bound the served document states is accepted by the real app, one just outside it
is refused with a 400 naming the parameter."""

import math

import aiohttp
import pytest

from .conftest import MODEL

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
SCHEMA = {CHAT: "ChatCompletionRequest", COMPLETIONS: "CompletionRequest",
          RESPONSES: "ResponsesRequest"}
BASE = {CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        COMPLETIONS: {"model": MODEL, "prompt": "hi"}, RESPONSES: {"model": MODEL, "input": "hi"}}
COUNTS = ("maxItems", "maxLength", "maxProperties")  # bounds on a count: whole numbers


async def _document(http, base):
    async with http.get(base + "/openapi.json") as resp:
        assert resp.status == 200
        return await resp.json()


async def test_openapi_document_is_served_and_covers_the_routes(gateway):
    async with aiohttp.ClientSession() as http:
        doc = await _document(http, gateway)
    assert doc["openapi"].startswith("3.1")
    assert set(doc["paths"]) == {"/v1/chat/completions", "/v1/completions", "/v1/models",
                                 "/v1/models/{model}", "/v1/responses",
                                 "/v1/responses/input_tokens",
                                 "/v1/responses/{response_id}",
                                 "/v1/responses/{response_id}/input_items",
                                 "/v1/responses/{response_id}/cancel",
                                 "/v1/conversations", "/v1/conversations/{conversation_id}",
                                 "/v1/conversations/{conversation_id}/items",
                                 "/v1/conversations/{conversation_id}/items/{item_id}",
                                 "/tokenize", "/detokenize", "/tokenizer_info",
                                 "/livez", "/readyz", "/health", "/openapi.json"}
    refs = {v["$ref"].rsplit("/", 1)[1] for v in _walk(doc) if isinstance(v, dict) and "$ref" in v}
    assert refs <= set(doc["components"]["schemas"])
    chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"400", "401", "413", "429", "503", "504"} <= set(chat)
    assert "Retry-After" in chat["429"]["headers"]


async def test_the_request_schemas_list_exactly_the_fields_the_parser_reads(gateway):
    """additionalProperties false, and the properties are the parser's field sets: a field the
    document does not list is refused by name (here, through the app), and none it lists is."""
    from services.gateway.conversations import ADD_FIELDS, CREATE_FIELDS, UPDATE_FIELDS
    from services.gateway.responses_api import (
        FUNCTION_CALL_FIELDS,
        FUNCTION_OUTPUT_FIELDS,
        INPUT_TOKENS_FIELDS,
        MESSAGE_ITEM_FIELDS,
        OUTPUT_TEXT_FIELDS,
        REASONING_FIELDS,
        REFUSAL_PART_FIELDS,
        RESPONSES_FIELDS,
    )
    from services.gateway.responses_api import TEXT_PART_FIELDS as INPUT_TEXT_FIELDS
    from services.gateway.responses_api import TOOL_FIELDS as FUNCTION_TOOL_FIELDS
    from services.gateway.schemas import (
        CHAT_FIELDS,
        COMPLETION_FIELDS,
        DETOKENIZE_FIELDS,
        JSON_SCHEMA_FIELDS,
        MESSAGE_FIELDS,
        RESPONSE_FORMAT_FIELDS,
        TEXT_PART_FIELDS,
        TOKENIZE_FIELDS,
    )
    from services.gateway.tools import (
        CALL_FIELDS,
        CALL_FUNCTION_FIELDS,
        CHOICE_FUNCTION_FIELDS,
        FUNCTION_FIELDS,
        TOOL_FIELDS,
    )

    async with aiohttp.ClientSession() as http:
        doc = await _document(http, gateway)
        schemas = doc["components"]["schemas"]
        for name, fields, route, base in (
                ("ChatCompletionRequest", CHAT_FIELDS, CHAT,
                 {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
                ("CompletionRequest", COMPLETION_FIELDS, COMPLETIONS,
                 {"model": MODEL, "prompt": "hi"}),
                ("ResponsesRequest", RESPONSES_FIELDS, RESPONSES, {"model": MODEL, "input": "hi"}),
                ("ResponsesInputTokensRequest", INPUT_TOKENS_FIELDS,
                 "/v1/responses/input_tokens", {"model": MODEL, "input": "hi"}),
                ("TokenizeRequest", TOKENIZE_FIELDS, "/tokenize", {"prompt": "hi"}),
                ("DetokenizeRequest", DETOKENIZE_FIELDS, "/detokenize", {"tokens": [1]}),
                ("ConversationCreateRequest", CREATE_FIELDS, "/v1/conversations", {})):
            assert schemas[name]["additionalProperties"] is False
            assert set(schemas[name]["properties"]) == fields
            async with http.post(gateway + route, json={**base, "not_a_field": 1}) as resp:
                assert resp.status == 400
                error = (await resp.json())["error"]
                assert (error["param"], error["code"]) == ("not_a_field", "unsupported_parameter")
        assert set(schemas["ConversationUpdateRequest"]["properties"]) == UPDATE_FIELDS
        assert set(schemas["ConversationItemsRequest"]["properties"]) == ADD_FIELDS
        message = schemas["ChatMessage"]
        part = message["properties"]["content"]["oneOf"][2]["items"]
        assert message["additionalProperties"] is False and part["additionalProperties"] is False
        assert set(message["properties"]) == MESSAGE_FIELDS
        assert set(part["properties"]) == TEXT_PART_FIELDS
        # the nested objects too: each closed, each listing exactly what the parser reads
        chat = schemas["ChatCompletionRequest"]["properties"]
        choice = chat["tool_choice"]["oneOf"][1]
        plain, with_schema = chat["response_format"]["oneOf"][:2]
        for obj, fields in ((schemas["Tool"], TOOL_FIELDS),
                            (schemas["Tool"]["properties"]["function"], FUNCTION_FIELDS),
                            (schemas["ToolCall"], CALL_FIELDS),
                            (schemas["ToolCall"]["properties"]["function"],
                             CALL_FUNCTION_FIELDS),
                            (choice, TOOL_FIELDS),
                            (choice["properties"]["function"], CHOICE_FUNCTION_FIELDS),
                            (plain, {"type"}), (with_schema, RESPONSE_FORMAT_FIELDS),
                            (with_schema["properties"]["json_schema"], JSON_SCHEMA_FIELDS),
                            (schemas["FunctionTool"], FUNCTION_TOOL_FIELDS)):
            assert obj["additionalProperties"] is False and set(obj["properties"]) == fields
        message_item, call, output, reasoning = schemas["ResponsesInputItem"]["oneOf"]
        text, output_text, refusal = message_item["properties"]["content"]["oneOf"][1][
            "items"]["oneOf"]
        for obj, fields in ((message_item, MESSAGE_ITEM_FIELDS), (call, FUNCTION_CALL_FIELDS),
                            (output, FUNCTION_OUTPUT_FIELDS), (reasoning, REASONING_FIELDS),
                            (text, INPUT_TEXT_FIELDS), (output_text, OUTPUT_TEXT_FIELDS),
                            (refusal, REFUSAL_PART_FIELDS)):
            assert obj["additionalProperties"] is False and set(obj["properties"]) == fields
        for bad, param in (({"role": "user", "content": "hi", "audio": {"id": "a"}},
                            "messages[0].audio"),
                           ({"role": "user", "content": [{"type": "text", "text": "hi",
                                                          "cache_control": {}}]},
                            "messages[0].content[0].cache_control")):
            async with http.post(gateway + CHAT, json={"model": MODEL, "messages": [bad]}) as resp:
                assert resp.status == 400
                error = (await resp.json())["error"]
                assert (error["param"], error["code"]) == (param, "unsupported_parameter")


def _field(name):
    return lambda value: {name: value}


# (route, property, keyword path to the bound inside the property, body from a value, param the
# 400 names). The bound itself is read from the served document, never from the code.
BOUNDS = [
    (CHAT, "max_tokens", ("maximum",), _field("max_tokens"), "max_tokens"),
    (CHAT, "max_tokens", ("minimum",), _field("max_tokens"), "max_tokens"),
    (CHAT, "max_completion_tokens", ("maximum",), _field("max_completion_tokens"),
     "max_completion_tokens"),
    (CHAT, "min_tokens", ("maximum",), _field("min_tokens"), "min_tokens"),
    (CHAT, "top_logprobs", ("maximum",), lambda v: {"logprobs": True, "top_logprobs": v},
     "top_logprobs"),
    (CHAT, "top_k", ("maximum",), _field("top_k"), "top_k"),
    (CHAT, "top_k", ("minimum",), _field("top_k"), "top_k"),
    (CHAT, "n", ("maximum",), _field("n"), "n"),
    (CHAT, "n", ("minimum",), _field("n"), "n"),
    (CHAT, "seed", ("maximum",), _field("seed"), "seed"),
    (CHAT, "seed", ("minimum",), _field("seed"), "seed"),
    (CHAT, "temperature", ("maximum",), _field("temperature"), "temperature"),
    (CHAT, "temperature", ("minimum",), _field("temperature"), "temperature"),
    (CHAT, "top_p", ("maximum",), _field("top_p"), "top_p"),
    (CHAT, "top_p", ("exclusiveMinimum",), _field("top_p"), "top_p"),
    (CHAT, "presence_penalty", ("maximum",), _field("presence_penalty"), "presence_penalty"),
    (CHAT, "frequency_penalty", ("minimum",), _field("frequency_penalty"), "frequency_penalty"),
    (CHAT, "repetition_penalty", ("maximum",), _field("repetition_penalty"),
     "repetition_penalty"),
    (CHAT, "repetition_penalty", ("exclusiveMinimum",), _field("repetition_penalty"),
     "repetition_penalty"),
    (CHAT, "min_p", ("maximum",), _field("min_p"), "min_p"),
    (CHAT, "messages", ("maxItems",),
     lambda v: {"messages": [{"role": "user", "content": "hi"}] * v}, "messages"),
    (CHAT, "stop", ("oneOf", 1, "maxItems"), lambda v: {"stop": [f"s{i}" for i in range(v)]},
     "stop"),
    (CHAT, "stop", ("oneOf", 0, "maxLength"), lambda v: {"stop": "s" * v}, "stop"),
    (CHAT, "stop_token_ids", ("maxItems",), lambda v: {"stop_token_ids": list(range(v))},
     "stop_token_ids"),
    (CHAT, "logit_bias", ("maxProperties",),
     lambda v: {"logit_bias": {str(i): 1 for i in range(v)}}, "logit_bias"),
    (CHAT, "logit_bias", ("additionalProperties", "maximum"),
     lambda v: {"logit_bias": {"7": v}}, "logit_bias"),
    (COMPLETIONS, "logprobs", ("maximum",), _field("logprobs"), "logprobs"),
    (COMPLETIONS, "prompt", ("oneOf", 2, "maxItems"), lambda v: {"prompt": ["hi"] * v},
     "prompt"),
    (COMPLETIONS, "prompt", ("oneOf", 1, "items", "maximum"), lambda v: {"prompt": [v]},
     "prompt[0]"),
    (COMPLETIONS, "prompt", ("oneOf", 1, "items", "minimum"), lambda v: {"prompt": [v]},
     "prompt[0]"),
    (COMPLETIONS, "max_tokens", ("maximum",), _field("max_tokens"), "max_tokens"),
    (RESPONSES, "max_output_tokens", ("maximum",), _field("max_output_tokens"),
     "max_output_tokens"),
    (RESPONSES, "max_output_tokens", ("minimum",), _field("max_output_tokens"),
     "max_output_tokens"),
    (RESPONSES, "top_logprobs", ("maximum",),
     lambda v: {"top_logprobs": v, "include": ["message.output_text.logprobs"]},
     "top_logprobs"),
    (RESPONSES, "temperature", ("maximum",), _field("temperature"), "temperature"),
    (RESPONSES, "top_p", ("exclusiveMinimum",), _field("top_p"), "top_p"),
    (RESPONSES, "metadata", ("maxProperties",),
     lambda v: {"metadata": {str(i): "v" for i in range(v)}}, "metadata"),
    (RESPONSES, "input", ("oneOf", 1, "maxItems"),
     lambda v: {"input": [{"role": "user", "content": "hi"}] * v}, "input"),
]


def _outside(keyword, bound, integer):
    """The nearest value the bound excludes, and the nearest it admits."""
    if keyword.startswith("max"):
        return (bound + 1 if integer else math.nextafter(bound, math.inf)), bound
    if keyword == "minimum":
        return (bound - 1 if integer else math.nextafter(bound, -math.inf)), bound
    assert keyword == "exclusiveMinimum", keyword
    return bound, math.nextafter(bound, math.inf)


@pytest.mark.parametrize(("route", "prop", "path", "body_of", "param"), BOUNDS,
                         ids=[f"{r.rsplit('/', 1)[1]}-{p}-{k[-1]}"
                              for r, p, k, _, _ in BOUNDS])
async def test_a_stated_bound_is_the_parsers_bound(gateway, engine, route, prop, path, body_of,
                                                   param):
    servicer, _ = engine
    servicer.context_window = 10**7  # 4096 messages fit: only the bound under test refuses
    async with aiohttp.ClientSession() as http:
        doc = await _document(http, gateway)
        node = doc["components"]["schemas"][SCHEMA[route]]["properties"][prop]
        for key in path[:-1]:
            node = node[key]
        integer = path[-1] in COUNTS or "integer" in node.get("type", ())
        refused, accepted = _outside(path[-1], node[path[-1]], integer)
        base = BASE[route]
        async with http.post(gateway + route, json={**base, **body_of(accepted)}) as resp:
            assert resp.status == 200, (accepted, await resp.text())
        async with http.post(gateway + route, json={**base, **body_of(refused)}) as resp:
            assert resp.status == 400, refused
            assert (await resp.json())["error"]["param"] == param


def _walk(node):
    yield node
    if isinstance(node, dict):
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


@pytest.mark.parametrize(("body", "accepted"), [
    ({"prompt": "hi", "max_tokens": 0}, False),
    ({"prompt": "hi", "max_tokens": 0, "echo": True}, True),
    ({"prompt": "hi", "max_tokens": 0, "echo": True, "min_tokens": 2}, False),
    ({"prompt": [[1, 2], "a"], "echo": True, "n": 2}, True),
    ({"prompt": ["a"] * 9, "n": 2}, False),  # the schema cannot count prompts times n
    ({"prompt": [3, True]}, False),
    ({"prompt": []}, False),
])
def test_completion_schema_and_parser_agree_on_prompt_forms_and_echo(body, accepted):
    """Where the completion schema's cross-field rules (max_tokens 0 only with echo) and the
    prompt's forms say yes or no, the parser says the same; the one rule the schema cannot
    state (at most 16 choices: prompts times n) is in its description."""
    import jsonschema

    from services.gateway.errors import InvalidRequest
    from services.gateway.openapi import DOCUMENT
    from services.gateway.schemas import MAX_CHOICES, parse_completion

    schema = DOCUMENT["components"]["schemas"]["CompletionRequest"]
    body = {"model": MODEL, **body}
    valid = jsonschema.Draft202012Validator(schema).is_valid(body)
    try:
        parse_completion(body)
        parsed = True
    except InvalidRequest:
        parsed = False
    over_cap = len(body["prompt"]) * body.get("n", 1) > MAX_CHOICES
    assert parsed == accepted and valid == (accepted or over_cap)
    if over_cap:
        assert f"at most {MAX_CHOICES} choices" in schema["properties"]["prompt"]["description"]


@pytest.mark.parametrize(("body", "accepted"), [
    ({"input": "hi"}, True),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                {"type": "reasoning", "summary": [], "content": [
                    {"type": "reasoning_text", "text": "t"}]},
                {"role": "assistant", "content": [{"type": "output_text", "text": "a",
                                                   "annotations": [], "logprobs": []}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "o"}]}, True),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     False),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, False),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "a",
                                         "schema": {"type": "object"}}}}, True),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}}, False),
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}],
      "tool_choice": {"type": "function", "name": "f"}}, True),
    ({"input": "hi", "tools": [{"type": "file_search"}]}, False),
    ({"input": "hi", "include": ["message.output_text.logprobs"], "top_logprobs": 3}, True),
    ({"input": "hi", "include": ["reasoning.encrypted_content"]}, True),
    ({"input": "hi", "include": ["file_search_call.results"]}, False),
    ({"input": "hi", "truncation": "auto"}, True),
    ({"input": "hi", "truncation": "middle"}, False),
    ({"input": "hi", "background": True}, True),
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}],
      "tool_choice": {"type": "allowed_tools", "mode": "required",
                      "tools": [{"type": "function", "name": "f"}]}}, True),
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}],
      "tool_choice": {"type": "allowed_tools", "mode": "never",
                      "tools": [{"type": "function", "name": "f"}]}}, False),
    ({"input": "hi", "conversation": "conv_" + "0" * 32}, True),
    ({"input": "hi", "conversation": {"id": "conv_" + "0" * 32}}, True),
    ({"input": "hi", "conversation": "conv_1"}, False),
    ({"input": "hi", "conversation": "conv_" + "0" * 32,
      "previous_response_id": "resp_" + "0" * 32}, False),
    ({"input": "hi", "conversation": None, "previous_response_id": "resp_" + "0" * 32}, True),
    ({"input": "hi", "background": True, "store": False}, False),
    ({"input": "hi", "background": True, "stream": True}, True),
    ({"input": "hi", "background": False, "stream": True}, True),
    ({"input": "hi", "previous_response_id": "resp_x"}, False),
])
def test_responses_schema_and_parser_agree(body, accepted):
    """The Responses request's schema and its parser say the same yes or no."""
    import jsonschema

    from services.gateway.errors import InvalidRequest
    from services.gateway.openapi import DOCUMENT
    from services.gateway.responses_api import parse_responses

    schemas = DOCUMENT["components"]["schemas"]
    body = {"model": MODEL, **body}
    # the request's schema inside a copy of the document, where its $refs resolve
    validator = jsonschema.Draft202012Validator(
        {"$ref": "#/components/schemas/ResponsesRequest", "components": {"schemas": schemas}})
    try:
        parse_responses(body).with_context([])
        parsed = True
    except InvalidRequest:
        parsed = False
    assert (parsed, validator.is_valid(body)) == (accepted, accepted)

