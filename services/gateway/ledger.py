"""Where admission's counts live: in this process, or in Redis shared by every gateway replica.

A ledger holds *leases*: one per admitted request, either queued (with its estimated prompt
tokens) or granted to an engine. Every decision is one atomic step (plain Python between awaits
locally, one Lua script in Redis), so the caps hold exactly however many gateways share them:

    enter(lease)         queue empty and an engine below max_inflight -> granted (least loaded)
                         else room in the queue (length and queued tokens) -> queued
                         else rejected
    grant_queued(lease)  an engine below max_inflight -> granted, the lease leaves the queue
                         (the preferred engine when it has a slot, else the least loaded)
    requeue(lease, t)    a queued lease's estimate becomes t tokens, if the queued tokens stay
                         under max_queued_tokens (or it is alone in the queue); else it is
                         refused and stays as it was (a lease no longer queued: accepted)
    move(lease, a, b)    a granted lease goes from engine a to engine b if b is below
                         max_inflight (prompt_cache_key's engine, admission.place)
    release(lease)       the lease is gone (queued or granted)

Redis leases expire after `lease_ttl_s` unless renewed, so the slots of a gateway that dies come
back by themselves. `SharedLedger` falls back to the local ledger when Redis is unreachable (one
log line), keeps retrying, and re-registers its live leases when Redis answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

log = logging.getLogger("strata.gateway.limits")

KEY_PREFIX = "strata:limits:"
_MAX_CONNECTIONS = 16


@dataclass(frozen=True)
class Limits:
    max_inflight: int  # per engine
    max_queue: int
    max_queued_tokens: int


@dataclass(frozen=True)
class Entered:
    engine: str | None  # granted at once
    queued: bool
    num_waiting: int  # queue length after this step (all gateways, when shared)

    @property
    def rejected(self) -> bool:
        return self.engine is None and not self.queued


class LocalLedger:
    """This process's counts. Methods are coroutines only to share the shared ledger's shape."""

    mode = "local"

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.inflight: dict[str, set[str]] = {}
        self.queued: dict[str, int] = {}  # lease -> estimated prompt tokens, oldest first

    @property
    def num_waiting(self) -> int:
        return len(self.queued)

    def _has_slot(self, engine: str) -> bool:
        return len(self.inflight.get(engine, ())) < self.limits.max_inflight

    def _least_loaded(self, engines: Sequence[str], prefer: str | None = None) -> str | None:
        if prefer in engines and self._has_slot(prefer):
            return prefer
        loads = {e: len(self.inflight.get(e, ())) for e in engines}
        free = [e for e in engines if loads[e] < self.limits.max_inflight]
        return min(free, key=loads.__getitem__, default=None)

    def refuses(self, engines: Sequence[str], tokens: int, pending: int = 0) -> bool:
        """Whether enter() would reject: no engine slot to grant (or a queue ahead) and no
        room in the queue, once `pending` entries still being decided elsewhere took theirs
        (slots first, then queue places). The first request in an empty queue always fits, so
        one huge prompt is not refused forever; after that the queued tokens stay under the
        cap."""
        lim = self.limits
        free = sum(max(0, lim.max_inflight - len(self.inflight.get(e, ()))) for e in engines)
        if not self.queued and pending < free:
            return False
        if len(self.queued) + max(0, pending - free) >= lim.max_queue:
            return True
        return bool(self.queued) and sum(self.queued.values()) + tokens > lim.max_queued_tokens

    async def enter(self, lease: str, engines: Sequence[str], tokens: int) -> Entered:
        if not self.queued and (engine := self._least_loaded(engines)) is not None:
            self.force_grant(lease, engine)
            return Entered(engine, False, 0)
        if not self.refuses(engines, tokens):
            self.force_enqueue(lease, tokens)
            return Entered(None, True, len(self.queued))
        return Entered(None, False, len(self.queued))

    async def grant_queued(self, lease: str, engines: Sequence[str],
                           prefer: str | None = None) -> str | None:
        engine = self._least_loaded(engines, prefer)
        if engine is not None:
            self.force_grant(lease, engine)
        return engine

    async def requeue(self, lease: str, tokens: int) -> bool:
        if lease not in self.queued:
            return True
        others = sum(self.queued.values()) - self.queued[lease]
        if len(self.queued) > 1 and others + tokens > self.limits.max_queued_tokens:
            return False
        self.queued[lease] = tokens
        return True

    async def move(self, lease: str, source: str, target: str) -> bool:
        if lease not in self.inflight.get(source, ()) or not self._has_slot(target):
            return False
        self.force_move(lease, source, target)
        return True

    async def release(self, lease: str, engine: str | None) -> None:
        self.queued.pop(lease, None)
        if engine is not None:
            self.inflight.get(engine, set()).discard(lease)

    def force_grant(self, lease: str, engine: str) -> None:
        self.queued.pop(lease, None)
        self.inflight.setdefault(engine, set()).add(lease)

    def force_enqueue(self, lease: str, tokens: int) -> None:
        self.queued[lease] = tokens

    def force_move(self, lease: str, source: str, target: str) -> None:
        self.inflight.get(source, set()).discard(lease)
        self.inflight.setdefault(target, set()).add(lease)


# KEYS: queue zset, queued-tokens hash, inflight zset per candidate engine.
# Scores are lease expiry times (ms, Redis clock); expired leases are purged before counting.
_PRELUDE = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
for _, m in ipairs(expired) do
  redis.call('ZREM', KEYS[1], m)
  redis.call('HDEL', KEYS[2], m)
end
local function least_loaded(max_inflight, prefer)
  if prefer and prefer >= 3 and prefer <= #KEYS then
    redis.call('ZREMRANGEBYSCORE', KEYS[prefer], '-inf', now)
    if redis.call('ZCARD', KEYS[prefer]) < max_inflight then return prefer end
  end
  local best, best_n = 0, max_inflight
  for i = 3, #KEYS do
    redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now)
    local n = redis.call('ZCARD', KEYS[i])
    if n < best_n then best, best_n = i, n end
  end
  return best
end
"""
# ARGV: lease, max_inflight, max_queue, max_queued_tokens, tokens, ttl_ms
# -> {1 granted | 2 queued | 0 rejected, engine index (0-based) or -1, queue length}
_ENTER = _PRELUDE + """
local lease, ttl = ARGV[1], tonumber(ARGV[6])
local waiting = redis.call('ZCARD', KEYS[1])
if waiting == 0 then
  local best = least_loaded(tonumber(ARGV[2]))
  if best > 0 then
    redis.call('ZADD', KEYS[best], now + ttl, lease)
    return {1, best - 3, 0}
  end
end
local queued_tokens = 0
for _, v in ipairs(redis.call('HVALS', KEYS[2])) do queued_tokens = queued_tokens + tonumber(v) end
if waiting < tonumber(ARGV[3]) and
   (waiting == 0 or queued_tokens + tonumber(ARGV[5]) <= tonumber(ARGV[4])) then
  redis.call('ZADD', KEYS[1], now + ttl, lease)
  redis.call('HSET', KEYS[2], lease, ARGV[5])
  return {2, -1, waiting + 1}
end
return {0, -1, waiting}
"""
# ARGV: lease, max_inflight, ttl_ms, preferred engine index (0-based) or -1
# -> engine index (0-based) or -1
_GRANT = _PRELUDE + """
local best = least_loaded(tonumber(ARGV[2]), tonumber(ARGV[4]) + 3)
if best == 0 then return -1 end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZADD', KEYS[best], now + tonumber(ARGV[3]), ARGV[1])
return best - 3
"""
# KEYS: queue zset, queued-tokens hash[, the lease's engine's inflight zset]. ARGV: lease.
# One script, not a MULTI/EXEC of three commands: a third less of the gateway's CPU a release.
_RELEASE = """
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
if KEYS[3] then redis.call('ZREM', KEYS[3], ARGV[1]) end
return 0
"""
# KEYS: queue zset, queued-tokens hash. ARGV: lease, max_queued_tokens, tokens.
# -> 1 accepted (or no longer queued), 0 refused
_REQUEUE = """
local old = redis.call('HGET', KEYS[2], ARGV[1])
if not old or not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 1 end
local total = 0
for _, v in ipairs(redis.call('HVALS', KEYS[2])) do total = total + tonumber(v) end
if redis.call('ZCARD', KEYS[1]) > 1 and
   total - tonumber(old) + tonumber(ARGV[3]) > tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
return 1
"""
# KEYS: the source engine's inflight zset, the target's. ARGV: lease, max_inflight, ttl_ms.
# -> 1 moved, 0 not (the target is full, or the lease is no longer at the source)
_MOVE = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[2]) then return 0 end
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[1])
return 1
"""
# KEYS: queued-tokens hash, then one zset per lease. ARGV: ttl_ms, 'xx' (renew) or 'add'
# (re-register), then lease, tokens ('' for a granted lease) pairs.
_RENEW = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[1])
for i = 2, #KEYS do
  local lease, tokens = ARGV[2 * i - 1], ARGV[2 * i]
  if ARGV[2] == 'xx' then
    redis.call('ZADD', KEYS[i], 'XX', now + ttl, lease)
  else
    redis.call('ZADD', KEYS[i], now + ttl, lease)
    if tokens ~= '' then redis.call('HSET', KEYS[1], lease, tokens) end
  end
end
return #KEYS - 1
"""


class RedisLedger:
    """The counts in Redis. Every method raises RedisError/OSError when Redis does not answer."""

    mode = "redis"

    def __init__(self, redis_url: str, limits: Limits, *, lease_ttl_s: float,
                 timeout_s: float = 0.5) -> None:
        self.limits = limits
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        # One quick retry (a connection closed by a restarted server), no backoff: admission
        # must fall back to local limits at once, not after seconds of retries.
        # A bounded pool: a burst queues its scripts on a few warm connections instead of
        # opening one connection per request.
        pool = aioredis.BlockingConnectionPool.from_url(
            redis_url, max_connections=_MAX_CONNECTIONS, timeout=timeout_s * 4,
            socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1))
        self.redis = aioredis.Redis(connection_pool=pool)
        self._enter = self.redis.register_script(_ENTER)
        self._grant = self.redis.register_script(_GRANT)
        self._renew = self.redis.register_script(_RENEW)
        self._release = self.redis.register_script(_RELEASE)
        self._move = self.redis.register_script(_MOVE)
        self._requeue = self.redis.register_script(_REQUEUE)
        self._queue_keys = [KEY_PREFIX + "queue", KEY_PREFIX + "queued_tokens"]

    @staticmethod
    def inflight_key(engine: str) -> str:
        return KEY_PREFIX + "inflight:" + engine

    async def enter(self, lease: str, engines: Sequence[str], tokens: int) -> Entered:
        keys = self._queue_keys + [self.inflight_key(e) for e in engines]
        lim = self.limits
        kind, index, waiting = await self._enter(keys, [
            lease, lim.max_inflight, lim.max_queue, lim.max_queued_tokens, tokens,
            self.lease_ttl_ms])
        return Entered(engines[index] if kind == 1 else None, kind == 2, int(waiting))

    async def grant_queued(self, lease: str, engines: Sequence[str],
                           prefer: str | None = None) -> str | None:
        keys = self._queue_keys + [self.inflight_key(e) for e in engines]
        preferred = engines.index(prefer) if prefer in engines else -1
        index = await self._grant(keys, [lease, self.limits.max_inflight, self.lease_ttl_ms,
                                         preferred])
        return engines[index] if index >= 0 else None

    async def requeue(self, lease: str, tokens: int) -> bool:
        return bool(await self._requeue(self._queue_keys, [
            lease, self.limits.max_queued_tokens, tokens]))

    async def move(self, lease: str, source: str, target: str) -> bool:
        keys = [self.inflight_key(source), self.inflight_key(target)]
        return bool(await self._move(keys, [lease, self.limits.max_inflight,
                                            self.lease_ttl_ms]))

    async def release(self, lease: str, engine: str | None) -> None:
        keys = self._queue_keys if engine is None else [*self._queue_keys,
                                                        self.inflight_key(engine)]
        await self._release(keys, [lease])

    async def renew(self, local: LocalLedger, *, reregister: bool = False) -> int:
        """Extend every lease this gateway holds; `reregister` also re-adds missing ones."""
        keys, args = [self._queue_keys[1]], [self.lease_ttl_ms, "add" if reregister else "xx"]
        for lease, tokens in local.queued.items():
            keys.append(self._queue_keys[0])
            args += [lease, tokens]
        for engine, leases in local.inflight.items():
            for lease in leases:
                keys.append(self.inflight_key(engine))
                args += [lease, ""]
        if len(keys) == 1:
            await self.redis.ping()
            return 0
        return int(await self._renew(keys, args))

    async def num_waiting(self) -> int:
        return int(await self.redis.zcard(self._queue_keys[0]))

    async def close(self) -> None:
        await self.redis.aclose()
        await self.redis.connection_pool.disconnect()


class SharedLedger:
    """Redis decides while it answers; this gateway's own leases are mirrored locally so the
    local ledger can take over (per-gateway caps) the moment Redis stops answering."""

    def __init__(self, redis_url: str, limits: Limits, *, lease_ttl_s: float = 15.0,
                 retry_s: float = 1.0, timeout_s: float = 0.5) -> None:
        self.redis_url = redis_url
        self.local = LocalLedger(limits)
        self.remote = RedisLedger(redis_url, limits, lease_ttl_s=lease_ttl_s,
                                  timeout_s=timeout_s)
        self.shared = True
        self.lease_ttl_s = lease_ttl_s
        self.retry_s = retry_s
        self._task: asyncio.Task[None] | None = None
        self._fell_back = asyncio.Event()  # cuts the renewal sleep short: start retrying

    @property
    def mode(self) -> str:
        return "redis" if self.shared else "local"

    @property
    def limits(self) -> Limits:
        return self.local.limits

    async def start(self) -> None:
        try:
            await self.remote.redis.ping()
            log.info("admission limits shared through Redis at %s (leases expire after %.0f s)",
                     self.redis_url, self.lease_ttl_s)
        except (RedisError, OSError) as exc:
            self._fall_back(exc)
        self._task = asyncio.create_task(self._maintain())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        # Leases left behind expire by themselves; a Redis that hangs must not hold up exit.
        with contextlib.suppress(TimeoutError, RedisError, OSError):
            async with asyncio.timeout(2.0):
                await self.remote.close()

    async def enter(self, lease: str, engines: Sequence[str], tokens: int) -> Entered:
        if self.shared:
            try:
                entered = await self.remote.enter(lease, engines, tokens)
            except (RedisError, OSError) as exc:
                self._fall_back(exc)
            else:
                if entered.engine is not None:
                    self.local.force_grant(lease, entered.engine)
                elif entered.queued:
                    self.local.force_enqueue(lease, tokens)
                return entered
        return await self.local.enter(lease, engines, tokens)

    def refuses(self, engines: Sequence[str], tokens: int, pending: int = 0) -> bool:
        """This gateway's own leases (mirrored locally) and its `pending` entries still at
        Redis already fill the limits: a refusal without a Redis round trip, as every
        gateway's together fill them too."""
        return self.local.refuses(engines, tokens, pending)

    async def grant_queued(self, lease: str, engines: Sequence[str],
                           prefer: str | None = None) -> str | None:
        if self.shared:
            try:
                engine = await self.remote.grant_queued(lease, engines, prefer)
            except (RedisError, OSError) as exc:
                self._fall_back(exc)
            else:
                if engine is not None:
                    self.local.force_grant(lease, engine)
                return engine
        return await self.local.grant_queued(lease, engines, prefer)

    async def requeue(self, lease: str, tokens: int) -> bool:
        if self.shared:
            try:
                accepted = await self.remote.requeue(lease, tokens)
            except (RedisError, OSError) as exc:
                self._fall_back(exc)
            else:
                if accepted and lease in self.local.queued:
                    self.local.queued[lease] = tokens
                return accepted
        return await self.local.requeue(lease, tokens)

    async def move(self, lease: str, source: str, target: str) -> bool:
        if self.shared:
            try:
                moved = await self.remote.move(lease, source, target)
            except (RedisError, OSError) as exc:
                self._fall_back(exc)
                return False  # it stays where it is, in Redis and here
            if moved:
                self.local.force_move(lease, source, target)
            return moved
        return await self.local.move(lease, source, target)

    async def release(self, lease: str, engine: str | None) -> None:
        await self.local.release(lease, engine)
        if self.shared:
            try:
                await self.remote.release(lease, engine)
            except (RedisError, OSError) as exc:
                self._fall_back(exc)  # the Redis lease expires by itself

    def _fall_back(self, exc: BaseException) -> None:
        if self.shared:
            log.warning("Redis at %s is unreachable (%s): admission falls back to this gateway's "
                        "own limits until it answers again (retrying every %.1f s)",
                        self.redis_url, exc or type(exc).__name__, self.retry_s)
        self.shared = False
        self._fell_back.set()

    async def _maintain(self) -> None:
        """Renew leases while shared; while local, retry Redis and re-register on success."""
        while True:
            self._fell_back.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.lease_ttl_s / 3 if self.shared else self.retry_s):
                    await self._fell_back.wait()
            try:
                if self.shared:
                    await self.remote.renew(self.local)
                else:
                    num = await self.remote.renew(self.local, reregister=True)
                    self.shared = True
                    log.info("Redis at %s answers again: admission limits are shared again "
                             "(%d live leases re-registered)", self.redis_url, num)
            except (RedisError, OSError) as exc:
                self._fall_back(exc)
            except Exception:
                log.exception("lease upkeep failed unexpectedly; retrying")


Ledger = LocalLedger | SharedLedger
