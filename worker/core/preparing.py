"""A pipeline's models made ready: for its next batch (``prepare``), and, while it is
unavailable, again in the background (``retry``).

A load runs on a daemon thread of its own, never on the event loop, bounded by the load
deadline (``worker.core.loading.Loads``: past it the load fails with ``load_timeout`` and its
pipeline is unavailable; a load still running at twice it asks for a restart); up to the
deadline the worker counts as loading, not stalled, and the held tasks waiting on it are kept
alive, so none is redelivered while it waits. A load that succeeded is told to the source
(``loaded``: NATS publishes the algorithms, Antenna records them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from config.errors import Failure
from worker.core.availability import Availability, retry_loads, tell_loaded
from worker.core.claims import Claims, best_effort
from worker.core.loading import Loads
from worker.core.ports import BatchEngine
from worker.core.settling import Settling
from worker.health.liveness import Liveness

Loaded = Callable[[str], Coroutine[Any, Any, None]]
_LOAD_TICK_S = 5.0  # while a model loads: progress noted, held tasks kept alive


class Preparing:
    def __init__(
        self,
        engine: BatchEngine,
        availability: Availability,
        claims: Claims,
        settling: Settling,
        liveness: Liveness,
        keepalive_tick_s: float,
        loaded: Loaded | None = None,
        loads: Loads | None = None,
    ) -> None:
        self._engine = engine
        self._availability = availability
        self._claims = claims
        self._settling = settling
        self._liveness = liveness
        self._tick_s = min(_LOAD_TICK_S, keepalive_tick_s)
        self.loaded = loaded  # the source told of a pipeline's models loaded, or None
        # At most one load thread per pipeline, each bounded (no deadline: 900 s).
        self._loads = loads or Loads(engine.load, 900.0, liveness.must_restart)

    async def prepare(self, pipeline: str) -> Failure | None:
        """``pipeline``'s models ready for its next batch (``Batches``'s ``Prepare``): loaded
        on a thread of their own when they are not; up to the load deadline the held tasks'
        ack waits are extended meanwhile, past it the load fails (``load_timeout``). The
        failure its tasks get when the models cannot be had."""
        if self._engine.ready(pipeline):
            return None

        async def tick() -> None:
            self._liveness.loading()
            await self._claims.keep_alive()

        failure = await self._loads.load(pipeline, tick, self._tick_s)
        if failure is None and self.loaded is not None:
            await self.loaded(pipeline)
        return failure

    async def retry(self, stop: asyncio.Event, engine_busy: Callable[[], bool]) -> None:
        """Until ``stop``: the loads of unavailable pipelines tried again, each on a thread of
        its own (never the event loop, never a batch's wait); meanwhile the tasks held for
        them (on their last delivery) are kept alive, and while they are all that is held the
        worker counts as loading, not stalled."""

        async def load(pipeline: str) -> Failure | None:
            failure = await self._loads.load(pipeline)  # bounded; no second thread
            if failure is None and self.loaded is not None:
                await tell_loaded(self.loaded, pipeline)
            return failure

        async def tick() -> None:
            available = self._availability.available
            waiting = [h for h in self._claims.all() if not available(h.task.pipeline)]
            for held in waiting:
                await best_effort(self._settling.keep_alive(held.delivered))
            if waiting and len(waiting) == len(self._claims) and not engine_busy():
                self._liveness.loading()

        await retry_loads(self._availability, load, stop, tick, self._tick_s)
