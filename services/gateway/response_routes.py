"""The Responses API around the store: the conversation a request continues, as its prompt
will be (`as_prompted`: previous_response_id's chain, truncation "auto"), and the stored
responses over HTTP (`GET` and `DELETE /v1/responses/{id}`, `GET
/v1/responses/{id}/input_items`). With API keys on, a response is its key's alone."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from aiohttp import web
from redis.exceptions import RedisError

from services.common.pb.strata.v1 import engine_pb2
from services.gateway import sse
from services.gateway.background import MARK_TTL_S, UNFINISHED, as_seen
from services.gateway.engine_client import chat_input
from services.gateway.engines import ready_engine, tokenizer_call
from services.gateway.errors import GatewayError, InvalidRequest
from services.gateway.responses_api import ResponsesInput, conversation, input_items_page
from services.gateway.schemas import MAX_MESSAGES
from services.gateway.state import BACKGROUND, CONFIG, POOL, REQUEST_ID, RESPONSE_STORE

REPLAY_WAIT_S = 0.25  # the longest a stream's reader waits for an event before it looks again
STREAM_ENDS = ("response.completed", "response.incomplete", "response.failed")


class ResponseNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"

    def __init__(self, response_id: str, ttl_s: float) -> None:
        super().__init__(f"no stored response {response_id!r}: it was made with store false, "
                         f"deleted, made with another API key, or neither made nor continued "
                         f"within the time the store keeps ({ttl_s / 3600:g} h, "
                         "--responses-ttl-s)", None, "not_found")


class ConversationNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"

    def __init__(self, conversation_id: str, ttl_s: float, param: str | None) -> None:
        super().__init__(f"no conversation {conversation_id!r}: it was deleted, made with "
                         f"another API key, or neither made nor used within the time the "
                         f"store keeps ({ttl_s / 3600:g} h, --responses-ttl-s)", param,
                         "conversation_not_found")


async def conversation_record(request: web.Request, conversation_id: str,
                              param: str | None = None) -> dict[str, Any]:
    """The stored record of a conversation of this caller's (404 where there is none)."""
    record = await request.app[RESPONSE_STORE].get(conversation_id, owner(request))
    if record is None or "conversation" not in record:
        raise ConversationNotFound(conversation_id, request.app[CONFIG].responses_ttl_s, param)
    return record


class StoreUnavailable(GatewayError):
    status = 503
    type = "service_unavailable"

    def __init__(self, exc: BaseException) -> None:
        super().__init__(f"the response store did not answer ({exc}); retry", None,
                         "store_unavailable", {"Retry-After": "1"})


def owner(request: web.Request) -> str:
    """Whose responses these are: the SHA-256 of the request's API key ("" with auth off; the
    auth middleware has already accepted the key)."""
    if not request.app[CONFIG].key_hashes:
        return ""
    key = request.headers.get("Authorization", "").partition(" ")[2].strip()
    return hashlib.sha256(key.encode()).hexdigest()


async def as_prompted(request: web.Request, spec: ResponsesInput) -> ResponsesInput:
    """The request as its prompt will be: after the stored conversation of its
    previous_response_id, and with truncation "auto", less the oldest turns the context window
    cannot hold."""
    spec = await with_previous(request, spec)
    return await _fit(request, spec) if spec.truncation == "auto" else spec


async def _fit(request: web.Request, spec: ResponsesInput) -> ResponsesInput:
    """The conversation cut at the earliest turn from which it fits the context window (the
    engine counts each candidate through the chat template: a binary search over the cuts)
    and Strata's MAX_MESSAGES. Where even its last turn does not fit the window, that turn
    alone goes on, for the engine's 400."""
    app = request.app
    cuts = [0, *spec.turn_starts()]

    async def few_enough(dropped: int) -> bool:
        return len(spec.with_context(spec.context, dropped).messages) <= MAX_MESSAGES

    first = await _first(cuts, few_enough)
    if not await few_enough(cuts[first]):
        raise InvalidRequest(f"even the conversation's last turn is over {MAX_MESSAGES} "
                             "messages; start a new one", "input")
    cuts = cuts[first:]
    address = await ready_engine(app, spec.model)
    status = app[POOL].statuses.get(address)
    if status is None or not status.context_window:
        return spec.with_context(spec.context, cuts[0])

    async def fits(dropped: int) -> bool:
        candidate = spec.with_context(spec.context, dropped)
        ids = await tokenizer_call(app, address, "Tokenize",
                                   engine_pb2.TokenizeRequest(chat=chat_input(candidate)))
        return len(ids.ids) < status.context_window

    return spec.with_context(spec.context, cuts[await _first(cuts, fits)])


async def _first(cuts: list[int], holds: Callable[[int], Awaitable[bool]]) -> int:
    """The index of the first cut for which `holds` (true of every later cut once of one),
    else the last: the first cut alone when it holds (the usual case), else a binary search."""
    if await holds(cuts[0]):
        return 0
    low, high = 1, len(cuts) - 1
    while low < high:
        mid = (low + high) // 2
        if await holds(cuts[mid]):
            high = mid
        else:
            low = mid + 1
    return low


async def with_previous(request: web.Request, spec: ResponsesInput) -> ResponsesInput:
    """A Responses request with what came before it: the stored conversation of its
    previous_response_id (a 400 naming the field where none is stored for this caller), or
    the items of its conversation (a 404 where there is none)."""
    if spec.conversation_id is not None:
        await conversation_record(request, spec.conversation_id, "conversation")
        return spec.with_context(await request.app[RESPONSE_STORE].items(spec.conversation_id))
    if spec.previous_response_id is None:
        return spec.with_context([])
    store, caller = request.app[RESPONSE_STORE], owner(request)
    ttl_h = request.app[CONFIG].responses_ttl_s / 3600
    record = await store.get(spec.previous_response_id, caller)
    if record is None:
        raise InvalidRequest(f"previous response {spec.previous_response_id!r} is not stored "
                             f"here: it was made with store false, deleted, made with another "
                             f"API key, or was last used longer ago than the store keeps "
                             f"({ttl_h:g} h, --responses-ttl-s)", "previous_response_id",
                             code="previous_response_not_found")
    if record["response"]["status"] in UNFINISHED:
        raise InvalidRequest(f"previous response {spec.previous_response_id!r} is "
                             f"{record['response']['status']} (a background response): "
                             "continue it once it has finished", "previous_response_id",
                             code="previous_response_unfinished")
    chain = [*record["ancestors"], spec.previous_response_id]
    earlier = await store.get_many(record["ancestors"], caller)
    if (gone := next((i for i, r in zip(record["ancestors"], earlier, strict=True)
                      if r is None), None)) is not None:
        raise InvalidRequest(f"response {gone!r}, earlier in the conversation that "
                             f"{spec.previous_response_id!r} continues, is no longer stored "
                             f"(deleted, or last used longer ago than the store keeps: "
                             f"{ttl_h:g} h); start the conversation again",
                             "previous_response_id", code="previous_response_not_found")
    await store.touch(chain)  # a conversation in use stays
    return replace(spec.with_context(conversation([*earlier, record])), ancestors=tuple(chain))


async def _record(request: web.Request, query: frozenset[str] = frozenset()) -> dict[str, Any]:
    for name in request.query:
        if name not in query:
            raise InvalidRequest(f"'{name}' is not a query parameter Strata reads here"
                                 + (f" (it reads {', '.join(sorted(query))})" if query else ""),
                                 name, code="unsupported_parameter")
    response_id = request.match_info["response_id"]
    record = await request.app[RESPONSE_STORE].get(response_id, owner(request))
    if record is None or "response" not in record:  # (a conversation's is no response)
        raise ResponseNotFound(response_id, request.app[CONFIG].responses_ttl_s)
    return record


async def retrieve(request: web.Request) -> web.StreamResponse:
    """A stored response; with `stream=true` (a background response created streaming) its
    stream's events after `starting_after`, live until it ends."""
    response_id = request.match_info["response_id"]
    record = await _record(request, frozenset({"stream", "starting_after"}))
    response = await as_seen(request.app[RESPONSE_STORE], response_id, record["response"])
    stream = request.query.get("stream", "false")
    if stream not in ("true", "false"):
        raise InvalidRequest(f"'stream' must be true or false; got {stream!r}", "stream")
    if stream == "false":
        if "starting_after" in request.query:
            raise InvalidRequest("'starting_after' goes with 'stream=true'", "starting_after")
        return web.json_response(response)
    if not record.get("logged"):
        raise InvalidRequest(f"response {response_id!r} has no stream to read: only a "
                             "background response created with 'stream': true keeps one; "
                             "GET it without stream", "stream")
    text = request.query.get("starting_after", "-1")
    if not text.lstrip("-").isdigit() or int(text) < -1:
        raise InvalidRequest(f"'starting_after' must be a sequence number (or -1: from the "
                             f"start); got {text!r}", "starting_after")
    return await replay(request, response_id, int(text))


async def replay(request: web.Request, response_id: str, after: int) -> web.StreamResponse:
    """A background response's stream from its event log: the events after sequence number
    `after`, then each as the gateway running it logs it, until one ends the stream
    (completed, incomplete, failed) or the response ends without one (cancelled, or its gateway
    stopped). A reader that leaves changes nothing for the response."""
    store = request.app[RESPONSE_STORE]
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
        "X-Request-Id": request[REQUEST_ID]})
    await response.prepare(request)
    finished = False
    while True:
        events = await store.read_events(response_id, after, REPLAY_WAIT_S)
        if events:
            await response.write(b"".join(sse.named(e) for e in events))
            after = events[-1]["sequence_number"]
            if events[-1]["type"] in STREAM_ENDS:
                break
        elif finished:
            break
        else:  # nothing new for a while: has it ended without a last event?
            record = await store.get(response_id, owner(request))
            finished = record is None or (await as_seen(
                store, response_id, record["response"]))["status"] not in UNFINISHED
    await response.write_eof()
    return response


async def cancel(request: web.Request) -> web.Response:
    """POST /v1/responses/{id}/cancel: a background response still queued or in progress is
    cancelled (here at once; run by another replica, at its next beat) and returned as it is
    then; a finished one is returned as it is."""
    app, response_id = request.app, request.match_info["response_id"]
    store = app[RESPONSE_STORE]
    response = (await _record(request))["response"]
    if not response.get("background"):
        raise InvalidRequest(f"response {response_id!r} was not made with 'background': true; "
                             "only background responses can be cancelled", None,
                             code="not_background")
    if response["status"] in UNFINISHED:
        run = app[BACKGROUND].cancel(response_id)
        if run is not None:
            await run.ended.wait()
        elif await store.cancel(response_id, MARK_TTL_S):
            await _until_finished(request, response_id)
        else:  # no gateway runs it any more: it stopped unfinished
            record = await _record(request)
            if record["response"]["status"] in UNFINISHED:
                record["response"] = {**record["response"], "status": "cancelled"}
                await store.put(response_id, record)
        response = (await _record(request))["response"]
    return web.json_response(await as_seen(store, response_id, response))


async def _until_finished(request: web.Request, response_id: str) -> None:
    """Wait (a few beats at most) for the replica running the response to store its end."""
    for _ in range(int(3 * MARK_TTL_S / 0.05)):
        if (await _record(request))["response"]["status"] not in UNFINISHED:
            return
        await asyncio.sleep(0.05)


async def delete(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    await _record(request)
    try:
        deleted = await request.app[RESPONSE_STORE].delete(response_id, owner(request))
    except (RedisError, OSError) as exc:
        raise StoreUnavailable(exc) from None
    if not deleted:  # deleted meanwhile by another request
        raise ResponseNotFound(response_id, request.app[CONFIG].responses_ttl_s)
    return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})


async def input_items(request: web.Request) -> web.Response:
    record = await _record(request, frozenset({"limit", "order", "after"}))
    return web.json_response(input_items_page(record["input_items"], dict(request.query)))
