"""The Conversations API: a conversation is a list of items kept by the gateway's response
store; a Responses request with `conversation` reads them before its input, and its input and
output join them once it is answered (handlers._respond).

    POST   /v1/conversations                     {items?, metadata?} -> the conversation
    GET    /v1/conversations/{id}                -> the conversation
    POST   /v1/conversations/{id}                {metadata} -> the conversation
    DELETE /v1/conversations/{id}                -> conversation.deleted
    POST   /v1/conversations/{id}/items          {items} -> a list of those items
    GET    /v1/conversations/{id}/items          ?limit&order&after -> a page of its items
    GET    /v1/conversations/{id}/items/{item}   -> the item
    DELETE /v1/conversations/{id}/items/{item}   -> the conversation

With API keys on, a conversation is its key's alone; it lives --responses-ttl-s after it was
made or last used, as stored responses do.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from aiohttp import web

from services.gateway.errors import GatewayError, InvalidRequest, first_unknown
from services.gateway.handlers import json_body
from services.gateway.response_routes import conversation_record, owner
from services.gateway.responses_api import input_items, input_items_page, metadata_field
from services.gateway.schemas import request_object
from services.gateway.state import CONFIG, RESPONSE_STORE

MAX_ITEMS_PER_CALL = 20  # items a create or an add may carry, as OpenAI's API allows
CREATE_FIELDS = frozenset({"items", "metadata"})
UPDATE_FIELDS = frozenset({"metadata"})
ADD_FIELDS = frozenset({"items"})


class ItemNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"


async def _body(request: web.Request, fields: frozenset[str]) -> dict[str, Any]:
    body = request_object(json_body(await request.read()))
    if (name := first_unknown(body, fields)) is not None:
        raise InvalidRequest(f"'{name}' is not a field Strata reads here: it reads "
                             f"{', '.join(sorted(fields))}", name, code="unsupported_parameter")
    return body


def _no_query(request: web.Request) -> None:
    if request.query:
        name = next(iter(request.query))
        raise InvalidRequest(f"'{name}' is not a query parameter Strata reads here", name,
                             code="unsupported_parameter")


async def create(request: web.Request) -> web.Response:
    _no_query(request)
    body = await _body(request, CREATE_FIELDS)
    items = (input_items(body["items"], "items", MAX_ITEMS_PER_CALL)
             if body.get("items") is not None else ())
    conversation = {"id": "conv_" + uuid.uuid4().hex, "object": "conversation",
                    "created_at": int(time.time()), "metadata": metadata_field(body)}
    store = request.app[RESPONSE_STORE]
    await store.put(conversation["id"], {"owner": owner(request), "conversation": conversation})
    if items:
        await store.append_items(conversation["id"], list(items))
    return web.json_response(conversation)


async def retrieve(request: web.Request) -> web.Response:
    _no_query(request)
    return web.json_response((await _record(request))["conversation"])


async def update(request: web.Request) -> web.Response:
    _no_query(request)
    record = await _record(request)
    body = await _body(request, UPDATE_FIELDS)
    if "metadata" not in body:
        raise InvalidRequest("'metadata' is required: it replaces the conversation's",
                             "metadata")
    record["conversation"]["metadata"] = metadata_field(body)
    await request.app[RESPONSE_STORE].put(record["conversation"]["id"], record)
    return web.json_response(record["conversation"])


async def delete(request: web.Request) -> web.Response:
    _no_query(request)
    record = await _record(request)
    conversation_id = record["conversation"]["id"]
    await request.app[RESPONSE_STORE].delete(conversation_id, owner(request))
    return web.json_response({"id": conversation_id, "object": "conversation.deleted",
                              "deleted": True})


async def add_items(request: web.Request) -> web.Response:
    _no_query(request)
    record = await _record(request)
    body = await _body(request, ADD_FIELDS)
    items = list(input_items(body.get("items"), "items", MAX_ITEMS_PER_CALL))
    await request.app[RESPONSE_STORE].append_items(record["conversation"]["id"], items)
    return web.json_response({"object": "list", "data": items, "first_id": items[0]["id"],
                              "last_id": items[-1]["id"], "has_more": False})


async def list_items(request: web.Request) -> web.Response:
    record = await _record(request)
    items = await request.app[RESPONSE_STORE].items(record["conversation"]["id"])
    return web.json_response(input_items_page(items, dict(request.query)))


async def get_item(request: web.Request) -> web.Response:
    _no_query(request)
    return web.json_response((await _item(request))[1])


async def delete_item(request: web.Request) -> web.Response:
    _no_query(request)
    record, item = await _item(request)
    await request.app[RESPONSE_STORE].remove_item(record["conversation"]["id"], item["id"])
    return web.json_response(record["conversation"])


async def _record(request: web.Request) -> dict[str, Any]:
    return await conversation_record(request, request.match_info["conversation_id"])


async def _item(request: web.Request) -> tuple[dict[str, Any], dict[str, Any]]:
    """The conversation's record and the item the path names."""
    record = await _record(request)
    item_id = request.match_info["item_id"]
    for item in await request.app[RESPONSE_STORE].items(record["conversation"]["id"]):
        if item["id"] == item_id:
            return record, item
    raise ItemNotFound(f"conversation {record['conversation']['id']!r} has no item "
                       f"{item_id!r} (kept for {request.app[CONFIG].responses_ttl_s / 3600:g} "
                       "h after its last use)", None, "item_not_found")
