"""Stored responses of the Responses API (`store`, `previous_response_id`, `GET` and `DELETE
/v1/responses/{id}`): one JSON record a response, kept for a time to live.

    LocalResponseStore   this gateway's memory, the oldest dropped past a byte budget
    RedisResponseStore   Redis (`--redis-url`): every gateway replica reads every response;
                         while Redis does not answer, records go to the local store instead

A record is `{"owner", "response", "input_items", "ancestors"}`: the response object as
returned, this request's input items, and the ids of the responses before it in its
conversation, oldest first (a following request's `previous_response_id` reads them all at
once: each turn is stored once, so a conversation's records grow with its length, not its
square). A record lives `ttl_s` after it was made or last continued (`touch`). `owner` is the
SHA-256 of the API key that made it, so with keys on one key cannot read another's responses
("" when auth is off).

A conversation (the Conversations API, `conv_` ids) is a record like a response's, `{"owner",
"conversation"}`, and a list of its items, appended to as responses continue it
(`append_items`, `items`, `remove_item`); both live `ttl_s` after it was made or last used.

A background response created with `stream: true` also has an *event log*: its stream's events
in order, so that a client can read the stream from any replica and resume it after a given
sequence number (`append_events`, `read_events`; a Redis stream whose entry ids are the
sequence numbers).

A background response (`background: true`) also has a *run mark* while a gateway runs it:
"running", renewed by that gateway every few seconds (`beat`), or "cancel" once a client asked
to cancel it (`cancel`, from any replica; the next beat tells the runner). A record still
queued or in progress whose mark has expired was left by a gateway that stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError

log = logging.getLogger("strata.gateway")

KEY_PREFIX = "strata:response:"
CONVERSATION_PREFIX = "strata:conversation:"  # a conversation's record ("conv_" ids)
ITEMS_PREFIX = "strata:conversation-items:"  # its items, a Redis list


def record_key(record_id: str) -> str:
    return (CONVERSATION_PREFIX if record_id.startswith("conv_") else KEY_PREFIX) + record_id
RUN_PREFIX = "strata:response-run:"
EVENTS_PREFIX = "strata:response-events:"
RUNNING, CANCEL = "running", "cancel"

Record = dict[str, Any]


class ResponseStore(Protocol):
    async def put(self, response_id: str, record: Record) -> None: ...

    async def get(self, response_id: str, owner: str) -> Record | None: ...

    async def get_many(self, response_ids: list[str], owner: str) -> list[Record | None]: ...

    async def touch(self, response_ids: list[str]) -> None: ...

    async def delete(self, response_id: str, owner: str) -> bool: ...

    async def beat(self, response_id: str, ttl_s: float) -> bool: ...

    async def cancel(self, response_id: str, ttl_s: float) -> bool: ...

    async def is_running(self, response_id: str) -> bool: ...

    async def end_run(self, response_id: str) -> None: ...

    async def append_events(self, response_id: str, events: list[Record]) -> None: ...

    async def append_items(self, conversation_id: str, items: list[Record]) -> None: ...

    async def items(self, conversation_id: str) -> list[Record]: ...

    async def remove_item(self, conversation_id: str, item_id: str) -> bool: ...

    async def read_events(self, response_id: str, after: int,
                          wait_s: float) -> list[Record]: ...

    async def close(self) -> None: ...


class LocalResponseStore:
    """Records in this process, each until its time to live; past `max_bytes` of JSON the
    oldest go first."""

    def __init__(self, ttl_s: float, max_bytes: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.clock = clock
        self._records: OrderedDict[str, tuple[float, str]] = OrderedDict()  # id -> (expiry, JSON)
        self._runs: dict[str, tuple[float, str]] = {}  # id -> (expiry, run mark)
        self._events: dict[str, tuple[float, list[str]]] = {}  # id -> (expiry, event JSON)
        self._lists: dict[str, list[str]] = {}  # a conversation's items (as its record lives)
        self._appended = asyncio.Condition()
        self.num_bytes = 0
        self.num_evicted = 0

    async def put(self, response_id: str, record: Record) -> None:
        self.put_text(response_id, json.dumps(record, separators=(",", ":")))

    def put_text(self, response_id: str, text: str) -> None:
        kept = self._lists.pop(response_id, None)  # a conversation's items outlive its update
        self._drop(response_id)
        if kept is not None:
            self._lists[response_id] = kept
        if len(text) > self.max_bytes:
            log.warning("response %s not stored: its record is %d bytes, over the %d the store "
                        "holds (raise --responses-max-bytes)", response_id, len(text),
                        self.max_bytes)
            return
        self._records[response_id] = (self.clock() + self.ttl_s, text)
        self.num_bytes += len(text)
        while self.num_bytes > self.max_bytes:
            oldest = next(iter(self._records))
            self._drop(oldest)
            self.num_evicted += 1
            if self.num_evicted == 1 or self.num_evicted % 1000 == 0:
                log.warning("stored responses past --responses-max-bytes (%d bytes): the oldest "
                            "dropped before their time to live (%d so far); raise the budget or "
                            "set --redis-url", self.max_bytes, self.num_evicted)

    async def get(self, response_id: str, owner: str) -> Record | None:
        entry = self._records.get(response_id)
        if entry is None:
            return None
        if entry[0] <= self.clock():
            self._drop(response_id)
            return None
        record: Record = json.loads(entry[1])
        return record if record.get("owner") == owner else None

    async def get_many(self, response_ids: list[str], owner: str) -> list[Record | None]:
        return [await self.get(i, owner) for i in response_ids]

    async def touch(self, response_ids: list[str]) -> None:
        """Their time to live starts again (a conversation in use)."""
        for response_id in response_ids:
            if (entry := self._records.get(response_id)) is not None:
                self._records[response_id] = (self.clock() + self.ttl_s, entry[1])

    async def delete(self, response_id: str, owner: str) -> bool:
        if await self.get(response_id, owner) is None:
            return False
        self._drop(response_id)
        return True

    async def beat(self, response_id: str, ttl_s: float) -> bool:
        """Mark the background response as running for `ttl_s` more; True where a client has
        asked to cancel it (the mark stays "cancel")."""
        mark = self._mark(response_id)
        self._runs[response_id] = (self.clock() + ttl_s, mark or RUNNING)
        return mark == CANCEL

    async def cancel(self, response_id: str, ttl_s: float) -> bool:
        """Ask the gateway running the response to cancel it; False where none runs it."""
        if self._mark(response_id) is None:
            return False
        self._runs[response_id] = (self.clock() + ttl_s, CANCEL)
        return True

    async def is_running(self, response_id: str) -> bool:
        return self._mark(response_id) is not None

    async def end_run(self, response_id: str) -> None:
        self._runs.pop(response_id, None)

    async def append_events(self, response_id: str, events: list[Record]) -> None:
        texts = [json.dumps(e, separators=(",", ":")) for e in events]
        log_ = self._events.get(response_id, (0.0, []))[1]
        self._events[response_id] = (self.clock() + self.ttl_s, log_ + texts)
        async with self._appended:
            self._appended.notify_all()

    async def read_events(self, response_id: str, after: int, wait_s: float) -> list[Record]:
        """The events after sequence number `after`, waiting up to `wait_s` for the first."""
        def ready() -> list[str]:
            entry = self._events.get(response_id)
            if entry is None or entry[0] <= self.clock():
                return []
            return entry[1][after + 1:]

        if not (texts := ready()):
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s), self._appended:
                    await self._appended.wait()
            texts = ready()
        return [json.loads(t) for t in texts]

    def _mark(self, response_id: str) -> str | None:
        entry = self._runs.get(response_id)
        if entry is None or entry[0] <= self.clock():
            self._runs.pop(response_id, None)
            return None
        return entry[1]

    async def close(self) -> None:
        self._records.clear()
        self._runs.clear()
        self._events.clear()
        self._lists.clear()
        self.num_bytes = 0

    def _drop(self, response_id: str) -> None:
        entry = self._records.pop(response_id, None)
        if entry is not None:
            self.num_bytes -= len(entry[1])
            self.num_bytes -= sum(len(t) for t in self._lists.pop(response_id, ()))

    async def append_items(self, conversation_id: str, items: list[Record]) -> None:
        if conversation_id not in self._records:
            return
        texts = [json.dumps(item, separators=(",", ":")) for item in items]
        self._lists.setdefault(conversation_id, []).extend(texts)
        self.num_bytes += sum(map(len, texts))
        await self.touch([conversation_id])
        self._records.move_to_end(conversation_id)  # the last evicted: it is in use

    async def items(self, conversation_id: str) -> list[Record]:
        return [json.loads(t) for t in self._lists.get(conversation_id, ())]

    async def remove_item(self, conversation_id: str, item_id: str) -> bool:
        texts = self._lists.get(conversation_id, [])
        for i, text in enumerate(texts):
            if json.loads(text)["id"] == item_id:
                self.num_bytes -= len(texts.pop(i))
                return True
        return False


class RedisResponseStore:
    """Records in Redis under `strata:response:<id>` with the time to live as their expiry.
    A Redis error sends the record to the local store (and a read that fails looks there), so
    a response made while Redis is away is still found by the gateway that made it."""

    def __init__(self, redis_url: str, ttl_s: float, local: LocalResponseStore, *,
                 timeout_s: float = 0.5) -> None:
        self.redis_url = redis_url
        self.ttl_s = ttl_s
        self.local = local
        self.redis = aioredis.Redis.from_url(redis_url, socket_timeout=timeout_s,
                                             socket_connect_timeout=timeout_s)

    async def put(self, response_id: str, record: Record) -> None:
        text = json.dumps(record, separators=(",", ":"))
        try:
            await self.redis.set(record_key(response_id), text, px=max(int(self.ttl_s * 1e3), 1))
        except (RedisError, OSError) as exc:
            log.warning("response %s: Redis at %s did not store it (%s); kept in this gateway "
                        "only, where other replicas cannot read it", response_id, self.redis_url,
                        exc)
            self.local.put_text(response_id, text)

    async def get(self, response_id: str, owner: str) -> Record | None:
        return (await self.get_many([response_id], owner))[0]

    async def get_many(self, response_ids: list[str], owner: str) -> list[Record | None]:
        """One MGET; a record Redis lacks (or all, while it does not answer) is looked for in
        this gateway's own."""
        if not response_ids:
            return []
        try:
            texts = await self.redis.mget([record_key(i) for i in response_ids])
        except (RedisError, OSError) as exc:
            log.warning("Redis at %s did not answer (%s); looking in this gateway's own records "
                        "only", self.redis_url, exc)
            texts = [None] * len(response_ids)
        out: list[Record | None] = []
        for response_id, text in zip(response_ids, texts, strict=True):
            if text is None:
                out.append(await self.local.get(response_id, owner))
                continue
            record: Record = json.loads(text)
            out.append(record if record.get("owner") == owner else None)
        return out

    async def touch(self, response_ids: list[str]) -> None:
        await self.local.touch(response_ids)
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for response_id in response_ids:
                    pipe.pexpire(record_key(response_id), max(int(self.ttl_s * 1e3), 1))
                await pipe.execute()
        except (RedisError, OSError) as exc:
            log.warning("Redis at %s did not renew %d records' time to live (%s)",
                        self.redis_url, len(response_ids), exc)

    async def delete(self, response_id: str, owner: str) -> bool:
        if await self.get(response_id, owner) is None:
            return False
        try:
            await self.redis.delete(record_key(response_id), ITEMS_PREFIX + response_id)
        except (RedisError, OSError) as exc:
            log.warning("response %s: Redis at %s did not delete it (%s)", response_id,
                        self.redis_url, exc)
            raise
        await self.local.delete(response_id, owner)
        return True

    async def beat(self, response_id: str, ttl_s: float) -> bool:
        """One SET with GET: the mark renewed and the one before it read at once, so a cancel
        that lands between two beats is seen by the next."""
        key, px = RUN_PREFIX + response_id, max(int(ttl_s * 1e3), 1)
        try:
            before = await self.redis.set(key, RUNNING, px=px, get=True)
            if before == CANCEL.encode():
                await self.redis.set(key, CANCEL, px=px)
                return True
            return await self.local.beat(response_id, ttl_s)
        except (RedisError, OSError) as exc:
            log.warning("background response %s: Redis at %s did not renew its run mark (%s); "
                        "other replicas may report it failed if this lasts", response_id,
                        self.redis_url, exc)
            return await self.local.beat(response_id, ttl_s)

    async def cancel(self, response_id: str, ttl_s: float) -> bool:
        asked = await self.local.cancel(response_id, ttl_s)
        try:
            return bool(await self.redis.set(RUN_PREFIX + response_id, CANCEL, xx=True,
                                             px=max(int(ttl_s * 1e3), 1))) or asked
        except (RedisError, OSError) as exc:
            log.warning("background response %s: Redis at %s did not take the cancel (%s)",
                        response_id, self.redis_url, exc)
            return asked

    async def is_running(self, response_id: str) -> bool:
        try:
            return bool(await self.redis.exists(RUN_PREFIX + response_id)) \
                or await self.local.is_running(response_id)
        except (RedisError, OSError):
            return True  # unknown: not reported as failed for a Redis that does not answer

    async def end_run(self, response_id: str) -> None:
        await self.local.end_run(response_id)
        with contextlib.suppress(RedisError, OSError):  # else the mark expires by itself
            await self.redis.delete(RUN_PREFIX + response_id)

    async def append_events(self, response_id: str, events: list[Record]) -> None:
        """XADD each with its sequence number as the entry id (0-<n+1>)."""
        key = EVENTS_PREFIX + response_id
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for event in events:
                    pipe.xadd(key, {"e": json.dumps(event, separators=(",", ":"))},
                              id=f"0-{event['sequence_number'] + 1}")
                pipe.pexpire(key, max(int(self.ttl_s * 1e3), 1))
                await pipe.execute()
        except (RedisError, OSError) as exc:
            log.warning("response %s: Redis at %s did not log %d stream events (%s); kept in "
                        "this gateway only", response_id, self.redis_url, len(events), exc)
            await self.local.append_events(response_id, events)

    async def read_events(self, response_id: str, after: int, wait_s: float) -> list[Record]:
        key = EVENTS_PREFIX + response_id
        try:
            found = await self.redis.xread({key: f"0-{after + 1}"},
                                           block=max(int(wait_s * 1e3), 1))
        except (RedisError, OSError) as exc:
            log.warning("Redis at %s did not answer (%s); reading this gateway's own stream "
                        "events only", self.redis_url, exc)
            return await self.local.read_events(response_id, after, wait_s)
        if not found:
            return await self.local.read_events(response_id, after, 0.0)
        return [json.loads(fields[b"e"]) for _, fields in found[0][1]]

    async def append_items(self, conversation_id: str, items: list[Record]) -> None:
        """RPUSH the items; the conversation's record and list live on (PEXPIRE both)."""
        px = max(int(self.ttl_s * 1e3), 1)
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.rpush(ITEMS_PREFIX + conversation_id,
                           *(json.dumps(item, separators=(",", ":")) for item in items))
                pipe.pexpire(ITEMS_PREFIX + conversation_id, px)
                pipe.pexpire(record_key(conversation_id), px)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            log.warning("conversation %s: Redis at %s did not take %d items (%s); kept in this "
                        "gateway only", conversation_id, self.redis_url, len(items), exc)
            await self.local.append_items(conversation_id, items)

    async def items(self, conversation_id: str) -> list[Record]:
        try:
            texts = await self.redis.lrange(ITEMS_PREFIX + conversation_id, 0, -1)
        except (RedisError, OSError) as exc:
            log.warning("Redis at %s did not answer (%s); reading this gateway's own "
                        "conversation items only", self.redis_url, exc)
            texts = []
        return [json.loads(t) for t in texts] + await self.local.items(conversation_id)

    async def remove_item(self, conversation_id: str, item_id: str) -> bool:
        key = ITEMS_PREFIX + conversation_id
        for text in await self.redis.lrange(key, 0, -1):
            if json.loads(text)["id"] == item_id:
                return bool(await self.redis.lrem(key, 1, text))
        return await self.local.remove_item(conversation_id, item_id)

    async def close(self) -> None:
        await self.redis.aclose()
        await self.local.close()
