"""The engine's subscription to the cache manager's plan versions (CacheManager.WatchPlans).

    watcher = PlanWatcher(address, engine_id, model_shape, on_plan,
                          device_memory_bytes=..., reserved_bytes=..., slots=...,
                          known_version=plan.version)
    watcher.start()          # a background task: subscribe, deliver, reconnect with backoff
    ...
    await watcher.stop()

`on_plan(plan)` (sync or async) is called once per plan version received, in order, with a
`services.engine.planning.Plan`; the engine applies it between decode steps. While the cache
manager is unreachable the watcher keeps the last plan (`watcher.plan`), logs one line, and
retries with exponential backoff; when it is back it resubscribes, telling it the version held,
so only a different version is delivered. A restarted cache manager numbers versions anew, so a
version may be lower than the one held: apply any version that differs.

`PlanApplier` is the engine's `on_plan`: it applies each version incrementally between steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import random
import time
from collections.abc import Awaitable, Callable

import grpc

from services.common.pb.strata.v1 import cachemgr_pb2, cachemgr_pb2_grpc
from services.engine.planning import Plan

log = logging.getLogger("strata.engine")

OnPlan = Callable[[Plan], Awaitable[None] | None]


class PlanWatcher:
    def __init__(self, address: str, engine_id: str, model: cachemgr_pb2.ModelShape,
                 on_plan: OnPlan, *, device_memory_bytes: int = 0, reserved_bytes: int = 0,
                 slots: int | None = None, known_version: int = 0, initial_backoff_s: float = 0.5,
                 max_backoff_s: float = 10.0) -> None:
        self.address = address
        self.engine_id = engine_id
        self.model = model
        self.on_plan = on_plan
        self.device_memory_bytes = device_memory_bytes
        self.reserved_bytes = reserved_bytes
        self.slots = slots  # the engine's slot count (None: the cache manager sizes one)
        self.version = known_version  # the version held (0 = none from the cache manager)
        self.plan: Plan | None = None  # the last plan received
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max_backoff_s
        self.connected = False
        self.num_plans = 0
        self.num_attempts = 0  # subscriptions tried: the first, then every retry
        self._task: asyncio.Task | None = None
        self._down_logged = False

    def start(self) -> asyncio.Task:
        assert self._task is None, "PlanWatcher.start() called twice"
        self._task = asyncio.create_task(self.run(), name=f"plan-watch-{self.engine_id}")
        return self._task

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def run(self) -> None:
        """Watch forever (until cancelled)."""
        backoff_s = self.initial_backoff_s
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = cachemgr_pb2_grpc.CacheManagerStub(channel)
            while True:
                try:
                    received = await self._watch_once(stub)
                    reason = "the stream ended (cache manager stopping?)"
                except grpc.aio.AioRpcError as exc:
                    received = self.connected
                    reason = f"{exc.code().name}: {exc.details()}"
                if received:
                    backoff_s = self.initial_backoff_s
                self._went_down(reason)
                await asyncio.sleep(backoff_s * random.uniform(0.8, 1.2))
                backoff_s = min(self.max_backoff_s, backoff_s * 2)

    async def _watch_once(self, stub: cachemgr_pb2_grpc.CacheManagerStub) -> bool:
        """One subscription; True if it delivered anything before it ended."""
        request = cachemgr_pb2.WatchPlansRequest(
            engine_id=self.engine_id, model=self.model,
            device_memory_bytes=self.device_memory_bytes, reserved_bytes=self.reserved_bytes,
            slots=self.slots, known_version=self.version)
        self.connected = False
        self.num_attempts += 1
        call = stub.WatchPlans(request)
        try:
            await call.wait_for_connection()  # raises AioRpcError when nobody answers
            self._came_back()
            async for message in call:
                await self._deliver(Plan(message.version, message.slots,
                                         tuple((p.layer, p.expert) for p in message.pairs),
                                         message.source))
        finally:
            call.cancel()
        return self.connected

    def _came_back(self) -> None:
        self.connected = True
        if self._down_logged:
            log.info("cache manager at %s is back; watching plan versions (holding v%d)",
                     self.address, self.version)
            self._down_logged = False

    def _went_down(self, reason: str) -> None:
        self.connected = False
        if not self._down_logged:
            log.warning("cache manager at %s unreachable for plan versions (%s); keeping plan "
                        "v%d and retrying with backoff", self.address, reason, self.version)
            self._down_logged = True

    async def _deliver(self, plan: Plan) -> None:
        self.plan, self.version = plan, plan.version
        self.num_plans += 1
        try:
            result = self.on_plan(plan)
            if inspect.isawaitable(result):
                await result
        except Exception:  # the engine's problem; the subscription goes on
            log.exception("applying plan v%d failed", plan.version)


class PlanApplier:
    """Applies plan versions to the engine's expert cache a few slots per engine step.

        applier = PlanApplier(engine, runner.cache, status, swap_slots=64)
        watcher = PlanWatcher(..., on_plan=applier)

    `applier(plan)` (any thread) queues a chore between engine steps that begins the plan
    (`cache.begin_plan`); each chore swaps at most `swap_slots` slots (`cache.apply_plan_step`)
    and queues the next until the plan is in place, so decode never waits for a whole refill.
    Then `status.plan_version` / `plan_source` name it. A newer plan replaces one in progress.
    """

    def __init__(self, engine: object, cache: object, status: object, swap_slots: int) -> None:
        assert swap_slots >= 1
        self.engine = engine
        self.cache = cache
        self.status = status
        self.swap_slots = swap_slots
        self._latest = 0  # plans received (any thread)
        self._applying = 0  # the plan the chores work on (loop thread)

    def __call__(self, plan: Plan) -> None:
        self._latest += 1
        number = self._latest
        self.engine.call_between_steps(lambda: self._begin(plan, number))  # type: ignore[attr-defined]

    def _begin(self, plan: Plan, number: int) -> None:
        if number != self._latest:  # a newer plan arrived before this one began
            return
        self._applying = number
        self.cache.begin_plan(plan.pairs)  # type: ignore[attr-defined]
        log.info("plan v%d (%s): applying between engine steps, at most %d slot swaps per step",
                 plan.version, plan.source, self.swap_slots)
        self._step(plan, number, time.perf_counter(), 0, 0)

    def _step(self, plan: Plan, number: int, started_s: float, swapped: int, steps: int) -> None:
        if number != self._applying:  # replaced by a newer plan
            return
        filled, done = self.cache.apply_plan_step(self.swap_slots)  # type: ignore[attr-defined]
        swapped, steps = swapped + filled, steps + 1
        if not done:
            self.engine.call_between_steps(  # type: ignore[attr-defined]
                lambda: self._step(plan, number, started_s, swapped, steps))
            return
        self.status.plan_version, self.status.plan_source = plan.version, plan.source  # type: ignore[attr-defined]
        log.info("plan v%d (%s) applied: %d slots swapped in %d steps over %.2f s",
                 plan.version, plan.source, swapped, steps, time.perf_counter() - started_s)
