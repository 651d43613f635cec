"""Background responses (`POST /v1/responses` with `background: true`): answered at once with
the response queued, then run on by this gateway under the request's admission ticket, its
record updated as it goes (queued -> in_progress -> completed, incomplete, failed or
cancelled) for clients that poll `GET /v1/responses/{id}`.

While it runs, the gateway renews the response's run mark in the store every `BEAT_S`
(response_store: "running", or "cancel" once any replica was asked to cancel it), so that

    POST /v1/responses/{id}/cancel   on this gateway cancels the task at once; on another one
                                     sets the mark to "cancel", which the next beat here reads
    GET  /v1/responses/{id}          of a record still queued or in progress whose mark has
                                     expired reports it failed: the gateway running it stopped

A gateway that shuts down cancels its runs and stores each as failed (drain waits for them
first: each holds an admission ticket).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from services.gateway.response_store import ResponseStore

log = logging.getLogger("strata.gateway")

BEAT_S = 1.0  # how often a running response's mark is renewed; it expires after MARK_TTL_S
MARK_TTL_S = 3 * BEAT_S
UNFINISHED = ("queued", "in_progress")
STOPPED = ("the gateway that ran this background response stopped before it finished; "
           "send the request again")


@dataclass(eq=False)
class BackgroundRun:
    """One background response this gateway runs."""

    response_id: str
    task: asyncio.Task[None] | None = None
    cancelled: bool = False  # a client asked for it (else a cancel is the gateway stopping)
    ended: asyncio.Event = field(default_factory=asyncio.Event)


class BackgroundRuns:
    """This gateway's running background responses, by id."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store
        self.runs: dict[str, BackgroundRun] = {}

    def start(self, response_id: str,
              body: Callable[[BackgroundRun], Coroutine[Any, Any, None]]) -> BackgroundRun:
        """Run `body(run)` as a task, with the run's mark renewed (and cancels read) until
        it ends."""
        run = BackgroundRun(response_id)
        self.runs[response_id] = run

        async def main() -> None:
            watcher = asyncio.create_task(self._watch(run))
            try:
                await body(run)
            finally:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
                await self.store.end_run(response_id)
                self.runs.pop(response_id, None)
                run.ended.set()

        run.task = asyncio.get_running_loop().create_task(main())
        return run

    def cancel(self, response_id: str) -> BackgroundRun | None:
        """Cancel a run of this gateway's (a client asked); None where it runs elsewhere."""
        run = self.runs.get(response_id)
        if run is not None and run.task is not None and not run.cancelled:
            run.cancelled = True
            run.task.cancel()
        return run

    async def close(self) -> None:
        """At shutdown: every run cancelled (each stores itself as failed)."""
        runs = list(self.runs.values())
        for run in runs:
            if run.task is not None:
                run.task.cancel()
        await asyncio.gather(*(run.task for run in runs if run.task is not None),
                             return_exceptions=True)

    async def _watch(self, run: BackgroundRun) -> None:
        while True:
            await asyncio.sleep(BEAT_S)
            if await self.store.beat(run.response_id, MARK_TTL_S):
                log.info("background response %s: cancelled from another gateway",
                         run.response_id)
                self.cancel(run.response_id)
                return


async def as_seen(store: ResponseStore, response_id: str,
                  response: dict[str, Any]) -> dict[str, Any]:
    """The stored response as a client should see it: a background one still queued or in
    progress whose run mark has expired is failed (its gateway stopped)."""
    if not response.get("background") or response.get("status") not in UNFINISHED \
            or await store.is_running(response_id):
        return response
    return {**response, "status": "failed",
            "error": {"code": "server_error", "message": STOPPED}}
