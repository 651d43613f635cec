"""The OpenAPI 3.1 document for the gateway's HTTP API, served at `/openapi.json`.

Written by hand next to schemas.py, whose bounds it repeats (test_openapi checks they agree).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from services.gateway.conversations import MAX_ITEMS_PER_CALL as MAX_CONVERSATION_ITEMS
from services.gateway.responses_api import (
    INCLUDES,
    LOGPROBS_INCLUDE,
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_KEYS,
    MAX_METADATA_VALUE_CHARS,
    REASONING_INCLUDE,
    SUMMARIES,
)
from services.gateway.schemas import (
    MAX_CACHE_KEY_CHARS,
    MAX_CHOICES,
    MAX_DETOKENIZE_TOKENS,
    MAX_GRAMMAR_CHARS,
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_NAME_CHARS,
    MAX_REPETITION_PENALTY,
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPLATE_KWARGS,
    MAX_TOKEN_ID,
    MAX_TOKENS_LIMIT,
    MAX_TOP_K,
    MAX_TOP_LOGPROBS,
    MAX_USER_CHARS,
    REASONING_EFFORTS,
)
from services.gateway.tools import MAX_TOOLS


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


_MAX_TOKENS = {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS_LIMIT}
_TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}
_SAMPLING = {
    "model": {"type": "string", "minLength": 1},
    "stream": {"type": ["boolean", "null"]},
    "stream_options": {"type": ["object", "null"],
                       "properties": {"include_usage": {"type": "boolean"}},
                       "additionalProperties": False},
    "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
    "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": ["integer", "null"], "minimum": -1, "maximum": MAX_TOP_K,
              "description": "Strata extension; 0 or -1 disables"},
    "seed": {"type": ["integer", "null"], "minimum": 0, "maximum": 2**64 - 1},
    "n": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_CHOICES,
          "description": "choices: one engine request each, seeds apart"},
    "stop": {"oneOf": [{"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
                       {"type": "array", "maxItems": MAX_STOP_SEQUENCES,
                        "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}},
                       {"type": "null"}]},
    "presence_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
    "logit_bias": {"type": ["object", "null"], "maxProperties": MAX_LOGIT_BIAS,
                   "propertyNames": {"pattern": "^[0-9]+$"},
                   "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
    "repetition_penalty": {"type": ["number", "null"], "exclusiveMinimum": 0,
                           "maximum": MAX_REPETITION_PENALTY,
                           "description": "vLLM extension: over the prompt and the output"},
    "min_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1,
              "description": "vLLM extension"},
    "min_tokens": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_TOKENS_LIMIT,
                   "description": "vLLM extension: no EOS or stop_token_ids before"},
    "ignore_eos": {"type": ["boolean", "null"], "description": "vLLM extension"},
    "stop_token_ids": {"type": ["array", "null"], "maxItems": MAX_STOP_TOKEN_IDS,
                       "items": {"type": "integer", "minimum": 0},
                       "description": "vLLM extension"},
    "response_format": {"oneOf": [
        {"type": "object", "required": ["type"], "additionalProperties": False,
         "properties": {"type": {"enum": ["text", "json_object"]}}},
        {"type": "object", "required": ["type", "json_schema"], "additionalProperties": False,
         "properties": {"type": {"const": "json_schema"}, "json_schema": {
             "type": "object", "required": ["name"], "additionalProperties": False,
             "properties": {
                 "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                 "schema": {"type": "object"},
                 "strict": {"type": ["boolean", "null"],
                            "description": "the output is held to the schema either way"}}}}},
        {"type": "null"}],
        "description": "constrained decoding: the answer parses as JSON (and validates); on a "
                       "chat request with tools, the JSON or the calls; gpt-oss: its final "
                       "message; json_schema's description is refused (the model would not "
                       "see it)"},
    "guided_json": {"type": ["object", "string", "null"],
                    "description": "vLLM extension: a JSON Schema the output follows"},
    "guided_regex": {"type": ["string", "null"], "minLength": 1,
                     "maxLength": MAX_GRAMMAR_CHARS,
                     "description": "vLLM extension: the output matches this regex"},
    "guided_choice": {"type": ["array", "null"], "minItems": 1,
                      "items": {"type": "string", "minLength": 1},
                      "description": "vLLM extension: the output is one of these"},
    "guided_grammar": {"type": ["string", "null"], "minLength": 1,
                       "maxLength": MAX_GRAMMAR_CHARS,
                       "description": "vLLM extension: a Lark grammar (llguidance's dialect)"},
    "user": {"type": ["string", "null"], "maxLength": MAX_USER_CHARS,
             "description": "the caller's end-user id, set on the request's trace span (user.id)"},
    "safety_identifier": {"type": ["string", "null"], "maxLength": MAX_USER_CHARS,
                          "description": "OpenAI's current name for user; the one taken when "
                                        "both are given"},
    "prompt_cache_key": {"type": ["string", "null"], "minLength": 1,
                         "maxLength": MAX_CACHE_KEY_CHARS,
                         "description": "requests with the same key go to the same engine "
                                        "while it has a free slot, so that they reuse their "
                                        "shared prefix there (with one engine: always)"},
}

_REASONING_EFFORT = {"enum": [*REASONING_EFFORTS, None],
                     "description": "gpt-oss's reasoning effort (its chat template's "
                                    "reasoning_effort); refused (400) by a model whose template "
                                    "has none"}
_TEMPLATE_KWARGS = {"type": ["object", "null"], "maxProperties": MAX_TEMPLATE_KWARGS,
                    "propertyNames": {"pattern": "^[A-Za-z_][A-Za-z0-9_]{0,63}$"},
                    "description": "vLLM extension: variables for the chat template (e.g. "
                                   "Qwen3's enable_thinking); one the model's template does "
                                   "not read is refused (400 naming it)"}
_RESPONSES_PROPERTIES: dict[str, Any] = {
    "model": {"type": "string", "minLength": 1},
    "input": {"oneOf": [
        {"type": "string"},
        {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES,
         "items": _ref("ResponsesInputItem")}]},
    "instructions": {"type": ["string", "null"],
                     "description": "a system message first; not carried over by "
                                    "previous_response_id"},
    "max_output_tokens": {**_MAX_TOKENS, "type": ["integer", "null"]},
    "temperature": _SAMPLING["temperature"], "top_p": _SAMPLING["top_p"],
    "stream": {"type": ["boolean", "null"],
               "description": "named events, response.created to response.completed / "
                              "response.incomplete / response.failed"},
    "store": {"type": ["boolean", "null"], "default": True,
              "description": "kept for --responses-ttl-s: GET /v1/responses/{id}, "
                             "previous_response_id"},
    "metadata": {"type": ["object", "null"], "maxProperties": MAX_METADATA_KEYS,
                 "propertyNames": {"maxLength": MAX_METADATA_KEY_CHARS},
                 "additionalProperties": {"type": "string",
                                          "maxLength": MAX_METADATA_VALUE_CHARS}},
    "previous_response_id": {"type": ["string", "null"], "pattern": "^resp_[0-9a-f]{32}$",
                             "description": "continue a stored response's conversation"},
    "conversation": {"oneOf": [
        {"type": "string", "pattern": "^conv_[0-9a-f]{32}$"},
        {"type": "object", "required": ["id"], "additionalProperties": False,
         "properties": {"id": {"type": "string", "pattern": "^conv_[0-9a-f]{32}$"}}},
        {"type": "null"}],
        "description": "a conversation (POST /v1/conversations): its items come before the "
                       "input, and the input and the answer join it; not with "
                       "previous_response_id"},
    "text": {"type": ["object", "null"], "additionalProperties": False, "properties": {
        "format": {"oneOf": [
            {"type": "object", "required": ["type"], "additionalProperties": False,
             "properties": {"type": {"enum": ["text", "json_object"]}}},
            {"type": "object", "required": ["type", "name", "schema"],
             "additionalProperties": False, "properties": {
                 "type": {"const": "json_schema"},
                 "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                 "schema": {"type": "object"}, "strict": {"type": ["boolean", "null"]}}},
            {"type": "null"}]}}},
    "tools": {"type": ["array", "null"], "maxItems": MAX_TOOLS,
              "items": _ref("FunctionTool")},
    "tool_choice": {"oneOf": [
        {"enum": ["none", "auto", "required"]},
        {"type": "object", "required": ["type", "name"], "additionalProperties": False,
         "properties": {"type": {"const": "function"}, "name": {"type": "string"}}},
        {"type": "object", "required": ["type", "mode", "tools"], "additionalProperties": False,
         "properties": {
            "type": {"const": "allowed_tools"}, "mode": {"enum": ["auto", "required"]},
            "tools": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["type", "name"], "additionalProperties": False,
                "properties": {"type": {"const": "function"}, "name": {"type": "string"}}}}}},
        {"type": "null"}], "description": "allowed_tools: every tool stays in the prompt; the "
                                          "answer may call only these"},
    "parallel_tool_calls": {"type": ["boolean", "null"]},
    "include": {"type": ["array", "null"], "items": {"enum": list(INCLUDES)},
                "description": f"'{REASONING_INCLUDE}': each reasoning item carries its "
                               "text compressed and encoded (not encrypted: the same text is "
                               "in its content), to be sent back by a client that keeps no "
                               "state"},
    "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_TOP_LOGPROBS,
                     "description": f"above 0 needs include ['{LOGPROBS_INCLUDE}']"},
    "user": _SAMPLING["user"],
    "safety_identifier": _SAMPLING["safety_identifier"],
    "prompt_cache_key": {**_SAMPLING["prompt_cache_key"], "description": (
        _SAMPLING["prompt_cache_key"]["description"] + "; without one, a stored "
        "conversation's turns go to one engine")},
    "truncation": {"enum": ["disabled", "auto", None],
                   "description": "auto: the conversation's oldest turns are left out of the "
                                  "prompt until it fits the context window"},
    "background": {"type": ["boolean", "null"],
                   "description": "answered at once, queued; the gateway runs it on and "
                                  "stores it: poll GET /v1/responses/{id}, cancel with POST "
                                  "/v1/responses/{id}/cancel (needs store); with stream, its "
                                  "events are logged: GET with stream=true reads them from "
                                  "any replica, resuming after starting_after"},
    "stream_options": {"type": ["object", "null"], "additionalProperties": False,
                       "properties": {"include_obfuscation": {"enum": [False, None]}},
                       "description": "with stream true; Strata pads no events"},
    "reasoning": {"type": ["object", "null"], "additionalProperties": False, "properties": {
        "effort": _REASONING_EFFORT,
        "summary": {"enum": [*SUMMARIES, None],
                    "description": "a summary of each reasoning item, which the same model "
                                   "writes in a second, greedy request once the item ends "
                                   "(auto: detailed); its tokens count in output_tokens"}}},
}

_SCHEMAS: dict[str, Any] = {
    "Error": {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["string", "null"]}}}}},
    "ChatMessage": {
        "type": "object", "required": ["role"], "additionalProperties": False,
        "description": "a field not listed is refused with a 400 naming it (a null passes)",
        "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"oneOf": [
            {"type": "string"}, {"type": "null"},
            {"type": "array", "items": {"type": "object", "required": ["type", "text"],
                                        "additionalProperties": False,
                                        "properties": {"type": {"const": "text"},
                                                       "text": {"type": "string"}}}}]},
        "name": {"type": ["string", "null"], "minLength": 1, "maxLength": MAX_NAME_CHARS,
                 "description": "the participant's name, for the chat template; refused (400) "
                                "where the model's template does not show it"},
        "tool_calls": {"type": ["array", "null"], "items": _ref("ToolCall"),
                       "description": "role assistant: its calls, in the history"},
        "tool_call_id": {"type": ["string", "null"],
                         "description": "role tool: the call it answers"},
        "refusal": {"type": ["string", "null"],
                    "description": "role assistant: a refusal it gave, taken as its content"},
        "reasoning_content": {"type": ["string", "null"],
                              "description": "role assistant: its reasoning as Strata returned "
                                             "it; the chat template decides which turns' "
                                             "reasoning the model sees"}}},
    "ToolCall": {
        "type": "object", "required": ["id", "function"], "additionalProperties": False,
        "properties": {
        "id": {"type": "string"}, "type": {"const": "function"},
        "index": {"type": ["integer", "null"],
                  "description": "the call's place in tool_calls, as a stream numbered it"},
        "function": {"type": "object", "required": ["name", "arguments"],
                     "additionalProperties": False, "properties": {
            "name": {"type": "string"}, "arguments": {"type": "string",
                                                      "description": "JSON text"}}}}},
    "Tool": {
        "type": "object", "required": ["type", "function"], "additionalProperties": False,
        "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "additionalProperties": False,
                     "properties": {
            "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
            "description": {"type": "string"}, "parameters": {"type": "object"},
            "strict": {"type": ["boolean", "null"],
                       "description": "true: under tool_choice auto too, every call parses "
                                      "and its arguments follow the parameters"}}}}},
    "ChatCompletionRequest": {
        "type": "object", "required": ["model", "messages"], "additionalProperties": False,
        "description": "a field not listed is refused with a 400 naming it (a null passes)",
        "properties": {
        **_SAMPLING,
        "messages": {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES,
                     "items": _ref("ChatMessage")},
        "max_tokens": {**_MAX_TOKENS, "type": ["integer", "null"]},
        "max_completion_tokens": {**_MAX_TOKENS, "type": ["integer", "null"]},
        "logprobs": {"type": ["boolean", "null"]},
        "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_TOP_LOGPROBS,
                         "description": "needs logprobs: true"},
        "tools": {"type": ["array", "null"], "minItems": 1, "maxItems": MAX_TOOLS,
                  "items": _ref("Tool")},
        "tool_choice": {"oneOf": [
            {"enum": ["none", "auto", "required"]},
            {"type": "object", "required": ["type", "function"], "additionalProperties": False,
             "properties": {
                "type": {"const": "function"}, "function": {
                    "type": "object", "required": ["name"], "additionalProperties": False,
                    "properties": {"name": {"type": "string"}}}}},
            {"type": "object", "required": ["type", "allowed_tools"],
             "additionalProperties": False, "properties": {
                "type": {"const": "allowed_tools"}, "allowed_tools": {
                    "type": "object", "required": ["mode", "tools"],
                    "additionalProperties": False, "properties": {
                        "mode": {"enum": ["auto", "required"]},
                        "tools": {"type": "array", "minItems": 1, "items": {
                            "type": "object", "required": ["type", "function"],
                            "additionalProperties": False, "properties": {
                                "type": {"const": "function"}, "function": {
                                    "type": "object", "required": ["name"],
                                    "additionalProperties": False,
                                    "properties": {"name": {"type": "string"}}}}}}}}}},
            {"type": "null"}], "description": "required / a function: the answer is a call "
                                              "whose arguments follow its parameters; "
                                              "allowed_tools: every tool stays in the prompt, "
                                              "the answer may call only these (auto: or "
                                              "answer in text)"},
        "parallel_tool_calls": {"type": ["boolean", "null"]},
        "reasoning_effort": _REASONING_EFFORT,
        "chat_template_kwargs": _TEMPLATE_KWARGS,
    }},
    "CompletionRequest": {
        "type": "object", "required": ["model", "prompt"], "additionalProperties": False,
        "description": "a field not listed is refused with a 400 naming it (a null passes)",
        # max_tokens 0 asks for the prompt alone: only with echo
        "if": {"required": ["max_tokens"], "properties": {"max_tokens": {"const": 0}}},
        "then": {"required": ["echo"], "properties": {"echo": {"const": True}},
                 "not": {"required": ["min_tokens"], "properties": {
                     "min_tokens": {"type": "integer", "exclusiveMinimum": 0}}}},
        "properties": {
        **_SAMPLING,
        "prompt": {"oneOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "minItems": 1, "items": _TOKEN_ID},
            {"type": "array", "minItems": 1, "maxItems": MAX_CHOICES, "items": {"oneOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "minItems": 1, "items": _TOKEN_ID}]}}],
            "description": "a text, token ids (taken as they are, each below the model's "
                           "vocabulary size), or a batch of either; each prompt gets n choices, "
                           f"at most {MAX_CHOICES} choices in all (prompts times n)"},
        "max_tokens": {**_MAX_TOKENS, "type": ["integer", "null"], "default": 16, "minimum": 0,
                       "description": "0 only with echo: the prompt (and its logprobs) alone"},
        "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_TOP_LOGPROBS,
                     "description": "alternatives per token (legacy form)"},
        "echo": {"type": ["boolean", "null"],
                 "description": "the prompt comes back before each choice's completion; with "
                                "logprobs, its tokens' too (the first token's null)"},
        "best_of": {"type": ["integer", "null"], "const": 1},
        "suffix": {"type": ["string", "null"],
                   "description": "fill in the middle: the text after the gap (text prompts, "
                                  "no echo); refused (400) by a model whose vocabulary has no "
                                  "FIM tokens"},
    }},
    "ResponsesRequest": {
        "type": "object", "required": ["model", "input"], "additionalProperties": False,
        "description": "the Responses API, served by the chat path: a field not listed is "
                       "refused with a 400 naming it (a null passes)",
        # background: stored
        "if": {"required": ["background"], "properties": {"background": {"const": True}}},
        "then": {"not": {"required": ["store"], "properties": {"store": {"const": False}}}},
        # a conversation or a previous response says what came before, not both
        "not": {"required": ["conversation", "previous_response_id"], "properties": {
            "conversation": {"type": ["string", "object"]},
            "previous_response_id": {"type": "string"}}},
        "properties": {
        **_RESPONSES_PROPERTIES,
    }},
    "ConversationCreateRequest": {
        "type": "object", "additionalProperties": False, "properties": {
            "items": {"type": ["array", "null"], "minItems": 1,
                      "maxItems": MAX_CONVERSATION_ITEMS, "items": _ref("ResponsesInputItem")},
            "metadata": _RESPONSES_PROPERTIES["metadata"]}},
    "ConversationUpdateRequest": {
        "type": "object", "required": ["metadata"], "additionalProperties": False,
        "properties": {"metadata": _RESPONSES_PROPERTIES["metadata"]}},
    "ConversationItemsRequest": {
        "type": "object", "required": ["items"], "additionalProperties": False,
        "properties": {"items": {"type": "array", "minItems": 1,
                                 "maxItems": MAX_CONVERSATION_ITEMS,
                                 "items": _ref("ResponsesInputItem")}}},
    "ResponsesInputTokensRequest": {
        "type": "object", "required": ["input"], "additionalProperties": False,
        "description": "what shapes a Responses request's prompt; the count is the "
                       "usage.input_tokens the request would report",
        "properties": {
        "model": {"type": ["string", "null"], "minLength": 1,
                  "description": "default: the first model served"},
        **{name: _RESPONSES_PROPERTIES[name] for name in (
            "input", "instructions", "previous_response_id", "tools", "tool_choice",
            "parallel_tool_calls", "truncation", "reasoning", "conversation")},
        "text": {**_RESPONSES_PROPERTIES["text"],
                 "description": "checked; a format adds no prompt tokens (the grammar holds "
                                "the output)"},
    }},
    "ResponsesInputItem": {"oneOf": [
        {"type": "object", "required": ["role", "content"], "additionalProperties": False,
         "properties": {
            "type": {"const": "message"}, "id": {"type": "string"}, "status": {},
            "role": {"enum": ["user", "system", "developer", "assistant"]},
            "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"oneOf": [
                {"type": "object", "required": ["type", "text"], "additionalProperties": False,
                 "properties": {"type": {"const": "input_text"}, "text": {"type": "string"}}},
                {"type": "object", "required": ["type", "text"], "additionalProperties": False,
                 "description": "an assistant's",
                 "properties": {"type": {"const": "output_text"}, "text": {"type": "string"},
                                "annotations": {}, "logprobs": {}}},
                {"type": "object", "required": ["type", "refusal"],
                 "additionalProperties": False, "description": "an assistant's",
                 "properties": {"type": {"const": "refusal"},
                                "refusal": {"type": "string"}}}]}}]}}},
        {"type": "object", "required": ["type", "call_id", "name", "arguments"],
         "additionalProperties": False, "properties": {
            "type": {"const": "function_call"}, "id": {"type": "string"}, "status": {},
            "call_id": {"type": "string", "minLength": 1},
            "name": {"type": "string", "minLength": 1}, "arguments": {"type": "string"}}},
        {"type": "object", "required": ["type", "call_id", "output"],
         "additionalProperties": False, "properties": {
            "type": {"const": "function_call_output"}, "id": {"type": "string"}, "status": {},
            "call_id": {"type": "string", "minLength": 1},
            "output": {"oneOf": [{"type": "string"}, {"type": "array", "items": {
                "type": "object", "required": ["type", "text"], "additionalProperties": False,
                "properties": {"type": {"const": "input_text"}, "text": {"type": "string"}}}}]}}},
        {"type": "object", "required": ["type"], "additionalProperties": False,
         "description": "the next assistant message's reasoning",
         "properties": {
            "type": {"const": "reasoning"}, "id": {"type": "string"}, "status": {},
            "summary": {"type": "array", "items": {
                "type": "object", "additionalProperties": False,
                "properties": {"type": {"const": "summary_text"}, "text": {"type": "string"}}}},
            "content": {"type": "array", "items": {
                "type": "object", "additionalProperties": False,
                "properties": {"type": {"const": "reasoning_text"},
                               "text": {"type": "string"}}}},
            "encrypted_content": {"type": ["string", "null"],
                                  "description": "a reasoning item's encrypted_content as "
                                                 "this server wrote it; its text where the "
                                                 "item has no content"}}}]},
    "FunctionTool": {
        "type": "object", "required": ["type", "name"], "additionalProperties": False,
        "description": "function tools only: hosted tools (web_search, file_search, ...) are "
                       "refused",
        "properties": {
            "type": {"const": "function"},
            "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
            "description": {"type": ["string", "null"]},
            "parameters": {"type": ["object", "null"]},
            "strict": {"type": ["boolean", "null"]}}},
    "TokenizeRequest": {
        "type": "object", "additionalProperties": False,
        "oneOf": [{"required": ["prompt"], "not": {"required": ["messages"]}},
                  {"required": ["messages"], "not": {"required": ["prompt"]}}],
        "description": "a completion prompt, or a chat (messages, tools) through the chat "
                       "template with its generation prompt",
        "properties": {
            "model": {"type": ["string", "null"], "minLength": 1},
            "prompt": {"type": "string"},
            "add_special_tokens": {"type": ["boolean", "null"], "const": False,
                                   "description": "Strata adds none; true is refused"},
            "messages": {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES,
                         "items": _ref("ChatMessage")},
            "tools": {"type": ["array", "null"], "minItems": 1, "maxItems": MAX_TOOLS,
                      "items": _ref("Tool")},
            "add_generation_prompt": {"type": ["boolean", "null"], "const": True,
                                      "description": "always added; false is refused"},
            "chat_template_kwargs": _TEMPLATE_KWARGS}},
    "DetokenizeRequest": {
        "type": "object", "required": ["tokens"], "additionalProperties": False,
        "properties": {
            "model": {"type": ["string", "null"], "minLength": 1},
            "tokens": {"type": "array", "maxItems": MAX_DETOKENIZE_TOKENS, "items": _TOKEN_ID}}},
    "StrataFigures": {"type": "object", "description": "per-request figures", "properties": {
        k: {"type": "number"} for k in ("queue_wait_ms", "ttft_ms", "engine_queue_ms",
                                         "decode_tok_s", "expert_hit_rate", "spill_ratio",
                                         "reused_prompt_tokens", "drafts_proposed",
                                         "drafts_accepted", "draft_acceptance_rate")} | {
        "engine_id": {"type": "string"}}},
    "Health": {"type": "object", "properties": {
        "status": {"enum": ["ok", "no_engine", "draining", "generation_failed"]},
        "engines": {"type": "array", "items": {"type": "object"}},
        "inflight": {"type": "integer"}, "queued": {"type": "integer"},
        "capacity": {"type": "integer"}, "limits": {"enum": ["local", "redis"]}}},
}

_DROP_HEADERS = {
    "Retry-After": {"schema": {"type": "integer", "minimum": 1},
                    "description": "seconds, from the observed drain rate"},
    "x-strata-drop-reason": {"schema": {
        "enum": ["queue_full", "queue_timeout", "no_engine", "draining", "engine_busy"]}},
}


def _error(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description,
                           "content": {"application/json": {"schema": _ref("Error")}}}
    if headers:
        out["headers"] = headers
    return out


_CHAT_STREAM = ("JSON body, or text/event-stream when stream is true (ends with `data: [DONE]`; "
                "a failure mid-stream ends with an error event and no [DONE])")


def _generation(summary: str, request: str, ok: str = _CHAT_STREAM) -> dict[str, Any]:
    return {"post": {
        "summary": summary, "security": [{"bearer": []}, {}],
        "parameters": [{"name": "X-Request-Id", "in": "header", "required": False,
                        "schema": {"type": "string", "pattern": "^[A-Za-z0-9._:\\-]{1,128}$"}},
                       {"name": "traceparent", "in": "header", "required": False,
                        "schema": {"type": "string"}}],
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {
            "200": {"description": ok,
                    "content": {"application/json": {"schema": {"type": "object"}},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            "400": _error("invalid parameter"), "401": _error("missing or invalid API key"),
            "404": _error("model not served"), "413": _error("body over --max-body-bytes"),
            "429": _error("queue full or queue timeout", _DROP_HEADERS),
            "500": _error("engine failure"),
            "503": _error("no engine ready, or the gateway is draining", _DROP_HEADERS),
            "504": _error("request deadline passed")}}}


def _tokenizer(method: str, summary: str, request: str | None) -> dict[str, Any]:
    op: dict[str, Any] = {
        "summary": summary, "security": [{"bearer": []}, {}],
        "responses": {"200": {"description": "ok", "content": {
                          "application/json": {"schema": {"type": "object"}}}},
                      "400": _error("invalid parameter"),
                      "401": _error("missing or invalid API key"),
                      "404": _error("model not served"),
                      "503": _error("no engine ready", _DROP_HEADERS)}}
    if request is not None:
        op["requestBody"] = {"required": True,
                             "content": {"application/json": {"schema": _ref(request)}}}
    else:
        op["parameters"] = [{"name": "model", "in": "query", "required": False,
                             "schema": {"type": "string"}}]
    return {method: op}


def _stored(summary: str, query: tuple[tuple[str, Any], ...] = (), *,
            path: tuple[str, ...] = ("response_id",), request: str | None = None,
            invalid: str = "a query parameter Strata does not read",
            missing: str = "no such stored response") -> dict[str, Any]:
    """An operation on what the response store keeps for the caller (its API key's own, with
    keys on): a response, a conversation, a conversation's item."""
    op: dict[str, Any] = {
        "summary": summary, "security": [{"bearer": []}, {}],
        "parameters": [{"name": name, "in": "path", "required": True,
                        "schema": {"type": "string"}} for name in path]
        + [{"name": name, "in": "query", "required": False, "schema": schema}
           for name, schema in query],
        "responses": {"200": {"description": "ok", "content": {
                          "application/json": {"schema": {"type": "object"}}}},
                      "400": _error(invalid),
                      "401": _error("missing or invalid API key"),
                      "404": _error(missing),
                      "503": _error("the response store (Redis) did not answer")}}
    if request is not None:
        op["requestBody"] = {"required": True,
                             "content": {"application/json": {"schema": _ref(request)}}}
    return op


def _conversation_op(summary: str, request: str | None = None, item: bool = False,
                     query: tuple[tuple[str, Any], ...] = (),
                     path: tuple[str, ...] = ("conversation_id",)) -> dict[str, Any]:
    """An operation on a conversation of the caller's (or on one of its items)."""
    return _stored(summary, query, path=(*path, "item_id") if item else path,
                   request=request, invalid="invalid parameter",
                   missing="no such conversation (or item)")


_PAGE = (("limit", {"type": "integer", "minimum": 1, "maximum": 100, "default": 20}),
         ("order", {"enum": ["asc", "desc"], "default": "desc"}),
         ("after", {"type": "string"}))


def _probe(summary: str, schema: str | None = None) -> dict[str, Any]:
    content = {"application/json": {"schema": _ref(schema) if schema else {"type": "object"}}}
    return {"get": {"summary": summary, "responses": {
        "200": {"description": "ok", "content": content},
        "503": {"description": "not ready / unhealthy", "content": content}}}}


DOCUMENT: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {"title": "Strata gateway", "version": "1",
             "description": "OpenAI-compatible API for Strata MoE engines"},
    "paths": {
        "/v1/chat/completions": _generation("Chat completion", "ChatCompletionRequest"),
        "/v1/completions": _generation("Text completion", "CompletionRequest"),
        "/v1/responses": _generation(
            "A response (the Responses API, served by the chat path)", "ResponsesRequest",
            "the response object, or text/event-stream when stream is true: named events "
            "(`event: response.output_text.delta` ...), numbered by sequence_number, ending "
            "with response.completed, response.incomplete or response.failed (a failure after "
            "the stream began: the error inside), no [DONE]"),
        "/v1/responses/input_tokens": _tokenizer(
            "post", "The input tokens a Responses request would count (usage.input_tokens)",
            "ResponsesInputTokensRequest"),
        "/v1/responses/{response_id}": {
            "get": _stored("A stored response (a background one as it stands: queued, "
                           "in_progress, or its end); stream=true reads a background "
                           "response's stream (one created streaming), after starting_after",
                           (("stream", {"type": "boolean", "default": False}),
                            ("starting_after", {"type": "integer", "minimum": -1,
                                                "default": -1}))),
            "delete": _stored("Delete a stored response")},
        "/v1/responses/{response_id}/cancel": {"post": _stored(
            "Cancel a background response still queued or in progress (a finished one comes "
            "back as it is; 400 for one not made with background)")},
        "/v1/responses/{response_id}/input_items": {"get": _stored(
            "A stored response's input items, a page at a time", _PAGE)},
        "/v1/conversations": {"post": _conversation_op(
            "A conversation: items a Responses request with `conversation` reads before its "
            "input, and that its answered turn joins", "ConversationCreateRequest", path=())},
        "/v1/conversations/{conversation_id}": {
            "get": _conversation_op("A conversation"),
            "post": _conversation_op("Replace a conversation's metadata",
                                     "ConversationUpdateRequest"),
            "delete": _conversation_op("Delete a conversation and its items")},
        "/v1/conversations/{conversation_id}/items": {
            "post": _conversation_op("Add items to a conversation", "ConversationItemsRequest"),
            "get": _conversation_op("A conversation's items, a page at a time", query=_PAGE)},
        "/v1/conversations/{conversation_id}/items/{item_id}": {
            "get": _conversation_op("An item of a conversation", item=True),
            "delete": _conversation_op("Remove an item from a conversation (the conversation "
                                       "comes back)", item=True)},
        "/v1/models": {"get": {"summary": "Models served by ready engines",
                               "security": [{"bearer": []}, {}],
                               "responses": {"200": {"description": "model list"},
                                             "503": _error("no engine", _DROP_HEADERS)}}},
        "/tokenize": _tokenizer("post", "A prompt's token ids, as /v1/completions takes it "
                                "(vLLM's endpoint)", "TokenizeRequest"),
        "/detokenize": _tokenizer("post", "Token ids' text, special tokens kept (vLLM's "
                                  "endpoint)", "DetokenizeRequest"),
        "/tokenizer_info": _tokenizer("get", "Special tokens, chat template, context window "
                                      "(vLLM's endpoint)", None),
        "/v1/models/{model}": {"get": {
            "summary": "One served model", "security": [{"bearer": []}, {}],
            "parameters": [{"name": "model", "in": "path", "required": True,
                            "schema": {"type": "string"}}],
            "responses": {"200": {"description": "the model"},
                          "404": _error("model not served"),
                          "503": _error("no engine", _DROP_HEADERS)}}},
        "/livez": _probe("Process is up"),
        "/readyz": _probe("An engine is ready and the gateway is not draining", "Health"),
        "/health": _probe("Deep: a real 1-token generation (cached a few seconds)", "Health"),
        "/openapi.json": {"get": {"summary": "This document",
                                  "responses": {"200": {"description": "OpenAPI 3.1"}}}},
    },
    "components": {"schemas": _SCHEMAS,
                   "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
}


async def handler(request: web.Request) -> web.Response:
    return web.json_response(DOCUMENT)
