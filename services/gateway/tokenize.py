"""vLLM's tokenizer endpoints, answered by an engine's own tokenizer: a prompt's ids as
/v1/completions takes it (POST /tokenize), ids' text (POST /detokenize), and the special tokens,
chat template and context window (GET /tokenizer_info); /tokenize also takes a chat
(`messages`, `tools`), its ids through the chat template as a chat request's prompt.
lm-evaluation-harness finds these by itself and then needs no copy of the model's tokenizer (a
GGUF's lives only inside its file): it sends token-id prompts built with them.

The Responses API's `POST /v1/responses/input_tokens` is one more: a conversation's ids through
the engine's chat template, counted.

Each is one unary RPC to a ready engine serving the model asked for (the first one's without
`model`), outside admission: no queue, no slot."""

from __future__ import annotations

from aiohttp import web

from services.common.pb.strata.v1 import engine_pb2
from services.gateway.engine_client import chat_input
from services.gateway.engines import ready_engine, served_models, tokenizer_call
from services.gateway.errors import EngineError
from services.gateway.handlers import json_body
from services.gateway.response_routes import as_prompted
from services.gateway.responses_api import INPUT_TOKENS_FIELDS, engine_param, parse_responses
from services.gateway.schemas import GenerateInput, Sampling, parse_detokenize, parse_tokenize
from services.gateway.state import POOL


async def tokenize(request: web.Request) -> web.Response:
    spec = parse_tokenize(json_body(await request.read()))
    address = await ready_engine(request.app, spec.model)
    message = (engine_pb2.TokenizeRequest(text=spec.prompt) if spec.prompt is not None else
               engine_pb2.TokenizeRequest(chat=chat_input(GenerateInput(
                   spec.model or "", Sampling(), messages=spec.messages, tools=spec.tools,
                   template_kwargs_json=spec.template_kwargs_json))))
    ids = await tokenizer_call(request.app, address, "Tokenize", message)
    status = request.app[POOL].statuses.get(address)
    return web.json_response({"count": len(ids.ids), "tokens": list(ids.ids),
                              "max_model_len": status.context_window if status else None,
                              "token_strs": None})


async def detokenize(request: web.Request) -> web.Response:
    spec = parse_detokenize(json_body(await request.read()))
    address = await ready_engine(request.app, spec.model)
    reply = await tokenizer_call(request.app, address, "Detokenize",
                                 engine_pb2.TokenIds(ids=spec.tokens))
    return web.json_response({"prompt": reply.text})


async def tokenizer_info(request: web.Request) -> web.Response:
    model = request.query.get("model")
    address = await ready_engine(request.app, model)
    info = await tokenizer_call(request.app, address, "GetTokenizerInfo",
                       engine_pb2.GetTokenizerInfoRequest())
    return web.json_response({
        "model": info.model, "bos_token": info.bos_token or None,
        "eos_token": info.eos_token or None, "pad_token": None,
        "eos_token_ids": list(info.eos_token_ids), "vocab_size": info.vocab_size,
        "model_max_length": info.context_window, "chat_template": info.chat_template or None,
        "add_bos_token": False})


async def count_input_tokens(request: web.Request) -> web.Response:
    """`POST /v1/responses/input_tokens` (the openai client's `responses.input_tokens.count`):
    the tokens a Responses request's prompt would be, its stored conversation, instructions
    and tools through the chat template, counted by the engine (the `usage.input_tokens` the
    request would report)."""
    body = json_body(await request.read())
    if isinstance(body, dict) and body.get("model") is None:  # optional: the first model served
        body = {**body, "model": (await served_models(request.app))[0]}
    spec = await as_prompted(request, parse_responses(body, INPUT_TOKENS_FIELDS,
                                                      "/v1/responses/input_tokens"))
    address = await ready_engine(request.app, spec.model)
    try:
        ids = await tokenizer_call(request.app, address, "Tokenize",
                          engine_pb2.TokenizeRequest(chat=chat_input(spec)))
    except EngineError as exc:
        if exc.param is not None:
            exc.param = engine_param(exc.param)
        raise
    return web.json_response({"object": "response.input_tokens", "input_tokens": len(ids.ids)})
