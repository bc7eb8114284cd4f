"""A pipeline's model load, bounded: each on a daemon thread of its own, awaited for at most
the load deadline (``WORKER_MODEL__LOAD_DEADLINE_S``), at most one thread per pipeline.

A load past its deadline is a failure of its pipeline (``reason`` ``load_timeout``): the
pipeline becomes unavailable (``availability``), its held tasks are given back, its load is
tried again on the retry schedule. A Python thread cannot be killed, so the load goes on: a
retry due while it still runs starts no second thread and fails at once (still unavailable);
one that has ended by then (its model resident, or its error) is followed by a fresh load,
which finds the model loaded. A load still running ``WEDGED_AFTER`` times its deadline after it
began is wedged: only a new process mends that (its thread holds the pipeline, perhaps the
cache's load lock), so ``wedged`` is told (the worker: ``Liveness.must_restart``, ``/livez``
503, healthwatch restarts it).

While a load is awaited within its deadline, ``tick`` is called every ``tick_s`` (the caller
keeps its held tasks alive and counts the load as progress): never for longer than the
deadline, so a hung load holds nothing for ever.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

from config.errors import Failure
from config.names import env_name
from worker.core.threads import in_daemon_thread

log = structlog.get_logger(__name__)
WEDGED_AFTER = 2.0  # a load still running this many times its deadline after it began: wedged
LOAD_TIMEOUT = "load_timeout"


@dataclass
class _Running:
    future: asyncio.Future[Failure | None]
    started_s: float
    timed_out: bool = False  # said once: a retry while it runs says nothing more


async def _no_tick() -> None:
    return None


class Loads:
    def __init__(
        self,
        load: Callable[[str], Failure | None],
        deadline_s: float,
        wedged: Callable[[str], None] = lambda _reason: None,
        *,
        clock: Callable[[], float] = time.monotonic,
        start: Callable[..., asyncio.Future[Failure | None]] = in_daemon_thread,
    ) -> None:
        self._load = load  # the engine's: makes a pipeline's models resident, on any thread
        self.deadline_s = deadline_s
        self._wedged = wedged
        self._clock = clock
        self._start = start
        self._running: dict[str, _Running] = {}
        self._told = False  # ``wedged`` is told once

    def running(self) -> dict[str, float]:
        """Each pipeline whose load thread has not returned, and for how long it has run."""
        now = self._clock()
        return {
            name: now - run.started_s
            for name, run in self._running.items()
            if not run.future.done()
        }

    async def load(
        self,
        pipeline: str,
        tick: Callable[[], Awaitable[None]] = _no_tick,
        tick_s: float = float("inf"),
    ) -> Failure | None:
        """``pipeline``'s models made resident within what is left of the deadline of its
        load thread (started now, unless one still runs); its failure, ``load_timeout`` past
        the deadline. A sticky device error the load met is raised, as the engine raised it."""
        running = self._running.get(pipeline)
        if running is None or running.future.done():
            running = _Running(self._start(self._load, pipeline), self._clock())
            running.future.add_done_callback(_retrieved)
            self._running[pipeline] = running
            asyncio.get_running_loop().call_later(
                self.deadline_s * WEDGED_AFTER, self._check_wedged, pipeline, running
            )
        while True:
            left_s = running.started_s + self.deadline_s - self._clock()
            if left_s <= 0:
                break
            done, _ = await asyncio.wait({running.future}, timeout=min(left_s, tick_s))
            if done:
                return running.future.result()
            if self._clock() < running.started_s + self.deadline_s:
                await tick()
        return self._timed_out(pipeline, running)

    def _timed_out(self, pipeline: str, running: _Running) -> Failure:
        running_s = self._clock() - running.started_s
        setting = env_name("model", "load_deadline_s")
        message = (
            f"pipeline {pipeline!r}: its model load has not finished after {running_s:.0f}s "
            f"({setting}={self.deadline_s:g})"
        )
        if running.timed_out:
            return Failure("model_load_failed", message, reason=LOAD_TIMEOUT)
        running.timed_out = True
        log.error(
            "model_load_timed_out",
            pipeline=pipeline,
            running_s=round(running_s, 1),
            deadline_s=self.deadline_s,
            action="the pipeline is unavailable, its tasks given back; no second load starts "
            "while this one runs",
        )
        return Failure("model_load_failed", message, reason=LOAD_TIMEOUT)

    def _check_wedged(self, pipeline: str, running: _Running) -> None:
        if running.future.done() or self._running.get(pipeline) is not running or self._told:
            return
        self._told = True
        running_s = self._clock() - running.started_s
        reason = (
            f"the model load of pipeline {pipeline!r} is wedged: running for {running_s:.0f}s, "
            f"{WEDGED_AFTER:g}x {env_name('model', 'load_deadline_s')}={self.deadline_s:g}"
        )
        log.error(
            "model_load_wedged",
            pipeline=pipeline,
            running_s=round(running_s, 1),
            action="asking for a restart (/livez 503): a thread cannot be stopped",
        )
        self._wedged(reason)


def _retrieved(future: asyncio.Future[Failure | None]) -> None:
    """A load's error is read even when nobody waits for it any more (it ended past its
    deadline), so asyncio does not report it as never retrieved."""
    if not future.cancelled():
        future.exception()
