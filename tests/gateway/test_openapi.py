"""/openapi.json: served, well formed, covers every route, and agrees with the parser's bounds."""

import aiohttp

from services.gateway import schemas
from services.gateway.openapi import DOCUMENT


async def test_openapi_document_is_served_and_covers_the_routes(gateway):
    async with aiohttp.ClientSession() as http, http.get(gateway + "/openapi.json") as resp:
        assert resp.status == 200
        doc = await resp.json()
    assert doc["openapi"].startswith("3.1")
    assert set(doc["paths"]) == {"/v1/chat/completions", "/v1/completions", "/v1/models",
                                 "/livez", "/readyz", "/health", "/openapi.json"}
    refs = {v["$ref"].rsplit("/", 1)[1] for v in _walk(doc) if isinstance(v, dict) and "$ref" in v}
    assert refs <= set(doc["components"]["schemas"])
    chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"400", "401", "413", "429", "503", "504"} <= set(chat)
    assert "Retry-After" in chat["429"]["headers"]


def test_bounds_match_the_parser():
    chat = DOCUMENT["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert chat["max_tokens"]["maximum"] == schemas.MAX_TOKENS_LIMIT
    assert chat["top_logprobs"]["maximum"] == schemas.MAX_TOP_LOGPROBS
    assert chat["top_k"]["maximum"] == schemas.MAX_TOP_K
    assert chat["messages"]["maxItems"] == schemas.MAX_MESSAGES


def _walk(node):
    yield node
    if isinstance(node, dict):
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)
