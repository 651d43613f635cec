"""The engine registry in Redis: engines announce themselves, gateways discover them.

    engine:  EngineRegistration.start() ── every interval_s ──> SET strata:engine:<id> <json> PX ttl
                                                                 ZADD strata:engines <expiry> <id>
             EngineRegistration.stop()  ──> DEL + ZREM (gone at once, not after the TTL)
    gateway: EngineRegistry.engines()   ──> live entries (a dead engine's entry expires by TTL)

Each heartbeat carries the engine's address, id, model, load (running, waiting) and ready flag.
Both sides keep going when Redis is unreachable: the registration retries every interval and logs
once when Redis goes away and once when it is back; the reader raises `RegistryUnavailable` so
the gateway can keep its last known list.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

log = logging.getLogger("strata.registry")

KEY_PREFIX = "strata:engine:"
INDEX_KEY = "strata:engines"


class RegistryUnavailable(RuntimeError):
    """Redis did not answer a registry read."""


@dataclass(frozen=True)
class EngineLoad:
    running: int = 0
    waiting: int = 0
    ready: bool = True


@dataclass(frozen=True)
class EngineInfo:
    """One engine's latest heartbeat."""

    engine_id: str
    address: str  # host:port the gateway dials
    model: str
    running: int
    waiting: int
    ready: bool
    heartbeat_at: float  # unix seconds

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> EngineInfo:
        raw = json.loads(text)
        return cls(engine_id=str(raw["engine_id"]), address=str(raw["address"]),
                   model=str(raw["model"]), running=int(raw["running"]),
                   waiting=int(raw["waiting"]), ready=bool(raw["ready"]),
                   heartbeat_at=float(raw["heartbeat_at"]))


def _client(redis_url: str, timeout_s: float) -> aioredis.Redis:
    # One quick retry (a connection the server closed, e.g. after a restart), no backoff: a
    # heartbeat or read must not stall for seconds while Redis is away.
    return aioredis.Redis.from_url(redis_url, socket_timeout=timeout_s,
                                   socket_connect_timeout=timeout_s,
                                   retry=Retry(NoBackoff(), 1))


class EngineRegistration:
    """The engine side: `await start()` after the gRPC server serves, `await stop()` before it
    stops. `load()` is called for every heartbeat and must not block."""

    def __init__(self, redis_url: str, *, engine_id: str, address: str, model: str,
                 load: Callable[[], EngineLoad], ttl_s: float = 10.0,
                 interval_s: float = 2.0, timeout_s: float = 1.0) -> None:
        assert 0 < interval_s < ttl_s, "heartbeats must come well within the TTL"
        self.redis_url = redis_url
        self.engine_id = engine_id
        self.address = address
        self.model = model
        self._load = load
        self.ttl_s = ttl_s
        self.interval_s = interval_s
        self._redis = _client(redis_url, timeout_s)
        self._task: asyncio.Task[None] | None = None
        self._reachable = True
        self.num_heartbeats = 0
        self.num_failed_heartbeats = 0

    def info(self) -> EngineInfo:
        load = self._load()
        return EngineInfo(self.engine_id, self.address, self.model, load.running, load.waiting,
                          load.ready, time.time())

    async def heartbeat(self) -> bool:
        """Write one heartbeat now; False (logged once per outage) if Redis did not take it."""
        info = self.info()
        ttl_ms = int(self.ttl_s * 1000)
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.set(KEY_PREFIX + self.engine_id, info.to_json(), px=ttl_ms)
                pipe.zadd(INDEX_KEY, {self.engine_id: info.heartbeat_at + self.ttl_s})
                await pipe.execute()
        except (RedisError, OSError) as exc:
            self.num_failed_heartbeats += 1
            if self._reachable:
                log.warning("engine %s: registry heartbeat to %s failed (%s); retrying every "
                            "%.1f s, gateways drop this engine after %.0f s", self.engine_id,
                            self.redis_url, exc, self.interval_s, self.ttl_s)
            self._reachable = False
            return False
        if not self._reachable:
            log.info("engine %s: registry at %s reachable again", self.engine_id, self.redis_url)
        self._reachable = True
        self.num_heartbeats += 1
        return True

    async def start(self) -> None:
        if await self.heartbeat():
            log.info("engine %s registered at %s as %s (TTL %.0f s)", self.engine_id,
                     self.redis_url, self.address, self.ttl_s)
        self._task = asyncio.create_task(self._beat_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.delete(KEY_PREFIX + self.engine_id)
                pipe.zrem(INDEX_KEY, self.engine_id)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            log.warning("engine %s: could not deregister (%s); the entry expires in %.0f s",
                        self.engine_id, exc, self.ttl_s)
        await self._redis.aclose()

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.heartbeat()
            except Exception:  # a load() bug must not stop the heartbeats
                log.exception("engine %s: heartbeat failed unexpectedly", self.engine_id)


class EngineRegistry:
    """The gateway side: which engines are alive now."""

    def __init__(self, redis_url: str, timeout_s: float = 1.0) -> None:
        self.redis_url = redis_url
        self._redis = _client(redis_url, timeout_s)

    async def engines(self) -> list[EngineInfo]:
        """Live engines, sorted by engine_id. Raises RegistryUnavailable."""
        try:
            await self._redis.zremrangebyscore(INDEX_KEY, "-inf", time.time())
            ids = await self._redis.zrange(INDEX_KEY, 0, -1)
            if not ids:
                return []
            values = await self._redis.mget([KEY_PREFIX + i.decode() for i in ids])
        except (RedisError, OSError) as exc:
            raise RegistryUnavailable(f"registry at {self.redis_url}: {exc}") from None
        found = []
        for value in values:
            if value is None:  # expired between the two reads
                continue
            try:
                found.append(EngineInfo.from_json(value))
            except (ValueError, KeyError, TypeError):
                log.warning("ignoring a malformed registry entry: %r", value[:200])
        return sorted(found, key=lambda e: e.engine_id)

    async def close(self) -> None:
        await self._redis.aclose()
