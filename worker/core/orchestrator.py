"""The orchestrator: start, serve, drain, end.

The event loop only orchestrates; loads and forward passes run on the engine's thread.
It builds the core's rooms once and runs their loops; each room owns one job, and none calls
back up into this one:

- the source (``link.SourceLink``: a ``TaskSource``, its ``Settler`` and results lookup, its
  fetch wait and keep-alive tick; NATS's or Antenna's, it is told which);
- ``Fetching`` (``fetching.py``): the fetch loop; ``Admission`` (``admission.py``): what a
  delivered task becomes (dead letter, error result, done before, or a held task);
- ``Claims`` (``claims.py``): what is held, the room left, the keep-alive, the bounded
  give-back;
- ``Batches`` (``batches.py``): batch formation and dispatch to the engine thread; its models
  made ready by ``Preparing`` (``preparing.py``), its run settled by ``BatchSettling``
  (``settling.py``: the verdict on each task, ``verdicts.decide``, carried out by the source's
  settler); ``BatchObserver`` (``health/observer.py``): liveness, metrics and guards;
- ``Endings`` (``endings.py``): every way the run ends, as a value (``Exit``);
- ``Drain`` (``drain.py``): once stopped, the batch in hand finished, the rest given back.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from worker.core.admission import Admission
from worker.core.availability import Availability
from worker.core.batches import Batches
from worker.core.claims import Claims, keep_alive_while_advancing
from worker.core.drain import Drain
from worker.core.dropping import InactiveJobDrops
from worker.core.endings import Endings, end_when_gone, end_when_idle
from worker.core.exits import Exit
from worker.core.fetching import Fetching
from worker.core.link import Helper, SourceLink
from worker.core.loading import Loads
from worker.core.ports import BatchEngine, CoreSettings
from worker.core.preparing import Preparing
from worker.core.results import ResultMaker
from worker.core.settling import BatchSettling, Settling
from worker.health.liveness import Liveness
from worker.health.metrics import Metrics
from worker.health.observer import BatchObserver

_BLOCKED_TICK_S = 1.0
_PROCESSOR = "process-loop"  # the batches' run: its failure is said the moment it is raised


@dataclass
class Services:
    """What the orchestrator talks to; built by the app from the source's parts."""

    link: SourceLink[Any]  # the task source and what it tells
    engine: BatchEngine
    engine_thread: Executor
    liveness: Liveness
    metrics: Metrics
    guard: Callable[[], str | None] | None = None  # why the process must be replaced, or None
    helpers: tuple[tuple[str, Helper], ...] = ()  # run alongside; one that fails ends us
    # A pipeline's models were loaded (the source publishes or records their algorithms).
    loaded: Callable[[str], Coroutine[Any, Any, None]] | None = None
    # Which pipelines cannot be loaded on this host now, and when each is tried again.
    availability: Availability = field(default_factory=Availability)


class Orchestrator:
    def __init__(self, settings: CoreSettings, services: Services, *, until_idle: bool = False):
        self.settings = settings
        self.services = services
        self.link = link = services.link
        self.availability = available = services.availability
        liveness, metrics = services.liveness, services.metrics
        self.settling = Settling(link.settler, metrics, link.kind)
        self.claims = Claims(
            settings.max_held,
            liveness,
            self.settling,
            lambda pipeline: not available.available(pipeline),
            settings.batch_size,  # held for unavailable pipelines outside the room
        )
        self.endings = Endings(liveness, settings.device, self.claims)
        self.results = ResultMaker(link.model_of)
        self.admission = self._admission()
        guard = services.guard or (lambda: None)
        observer = BatchObserver(metrics, liveness, guard, self.endings.limit)
        self.preparing = self._preparing()
        self.settled = BatchSettling(
            self.settling,
            self.claims,
            self.results,
            link.backoff,
            available.retry_in_s,
            metrics,
            liveness,
            self.endings.stop,
        )
        self.batches = self._batches(observer)
        self._drops = InactiveJobDrops(link.inactive_jobs, self.batches, self.claims, metrics)
        self.drain = Drain(
            link,
            self.batches,
            self.claims,
            self.settling,
            self.settled,
            liveness,
            settings.drain_timeout_s,
        )
        self._until_idle = until_idle

    def _preparing(self) -> Preparing:
        services = self.services
        return Preparing(
            services.engine,
            self.availability,
            self.claims,
            self.settling,
            services.liveness,
            self.link.keepalive_tick_s,
            services.loaded,
            Loads(
                services.engine.load,
                self.settings.load_deadline_s,
                services.liveness.must_restart,
            ),
        )

    def _admission(self) -> Admission:
        link, available = self.link, self.availability
        return Admission(
            self.settling,
            link.results,
            self.claims,
            self.results,
            available.available,
            link.backoff,
            link.extends_leases,
            available.retry_in_s,
        )

    def _batches(self, observer: BatchObserver) -> Batches:
        services = self.services
        return Batches(
            self.settings.batch_size,
            services.engine,
            services.engine_thread,
            lambda batch, report: observer.batch_done(len(batch), report, batch[0].task.pipeline),
            self.settled.settle,
            prepare=self.preparing.prepare,
            hold_per_load=self.settings.hold_per_load,
            on_device_failed=functools.partial(self.endings.failed, _PROCESSOR),
            availability=self.availability,
            holds_last=self.link.extends_leases,
        )

    @property
    def exit(self) -> Exit:
        """How the process ends; the first reason to stop wins (``Endings``)."""
        return self.endings.exit

    async def run(self, stop: asyncio.Event) -> Exit:
        """Work until ``stop`` is set or a part fails, then drain: finish the batch in hand,
        give back the rest. Returns how the process should end."""
        fetcher, processor, helpers = self._start()
        try:
            await self._serve(stop, {fetcher, processor, *helpers})
        finally:
            # Ours: the caller's event stays theirs (a second signal means "now").
            self.endings.stop.set()
            await self._drain(fetcher, processor, helpers)
        return self._end((fetcher, processor, *helpers))

    def _start(self) -> tuple[asyncio.Task[None], asyncio.Task[None], list[asyncio.Task[None]]]:
        """The loops: fetch, process (the batches), and the helpers alongside them."""
        link, claims, batches, endings = self.link, self.claims, self.batches, self.endings
        fetching = Fetching(
            link,
            self.admission,
            claims,
            batches,
            self._drops,
            self.availability,
            endings,
            self.settings.batch_size,
            until_idle=self._until_idle,
        )
        fetcher = asyncio.create_task(fetching.run(), name="fetch-loop")
        processor = asyncio.create_task(batches.run(), name=_PROCESSOR)
        helpers: list[tuple[str, Coroutine[Any, Any, None]]] = [
            ("source-watch", end_when_gone(link, endings)),
            ("load-retry", self.preparing.retry(endings.stop, batches.engine_busy)),
        ]
        if link.extends_leases:  # (Antenna: no call extends a reservation)
            advancing = keep_alive_while_advancing(
                claims,
                self.services.liveness.last_progress,
                batches.engine_busy,
                endings.stop,
                link.keepalive_tick_s,
            )
            helpers.append(("advancing-keepalive", advancing))
        if link.results_waiting is not None:
            helpers.append(("blocked-watch", self._note_blocked(link.results_waiting)))
        helpers += [(name, run(endings.stop)) for name, run in link.helpers]
        helpers += [(name, run(endings.stop)) for name, run in self.services.helpers]
        if self._until_idle:
            helpers.append(("until-idle", end_when_idle(link, claims, self.availability, endings)))
        tasks = [asyncio.create_task(coro, name=name) for name, coro in helpers]
        return fetcher, processor, tasks

    async def _serve(self, stop: asyncio.Event, loops: set[asyncio.Task[None]]) -> None:
        """Until the caller's stop, an ending (``Endings.stop``), or a loop that ended."""
        stopped = asyncio.create_task(stop.wait(), name="stop-wait")
        halted = asyncio.create_task(self.endings.stop.wait(), name="halt-wait")
        try:
            await asyncio.wait({*loops, stopped, halted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in (stopped, halted):
                waiting.cancel()
            await asyncio.gather(stopped, halted, return_exceptions=True)

    async def _drain(
        self,
        fetcher: asyncio.Task[None],
        processor: asyncio.Task[None],
        helpers: list[asyncio.Task[None]],
    ) -> None:
        """The fetch in flight finished, the helpers ended, then the drain (``Drain``)."""
        self.drain.begin()
        await self.drain.let_fetch_finish(fetcher)
        for helper in helpers:
            helper.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
        await self.drain.run(processor)

    def _end(self, loops: tuple[asyncio.Task[None], ...]) -> Exit:
        """How the process ends: a loop that ended raising is a part that failed."""
        for task in loops:
            if task.done() and not task.cancelled() and task.exception() is not None:
                self.endings.failed(task.get_name(), task.exception())
        return self.endings.exit

    async def _note_blocked(self, waiting: Callable[[], bool]) -> None:
        """While the engine is idle and finished results wait for the source's server, the
        worker is blocked on it, not wedged: the stall clock and the watchdog start over
        every ``_BLOCKED_TICK_S`` (docs/operating.md, timing budget). A frozen event loop ticks no
        more and a batch stuck in the engine keeps it busy, so either is still replaced."""
        ending = self.endings.stop
        while not ending.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ending.wait(), _BLOCKED_TICK_S)
            if len(self.claims) and waiting() and not self.batches.engine_busy():
                self.services.liveness.waiting_on_source()
