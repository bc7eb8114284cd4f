"""The orchestrator: fetch tasks, admit them, run them in batches, settle, drain.

The event loop only orchestrates; loads and forward passes run on the engine's thread.
Its parts, each in a module of its own:

- the source (``link.SourceLink``: a ``TaskSource``, its ``Settler`` and results lookup, its
  fetch wait and keep-alive tick; NATS's or Antenna's, it is told which);
- ``Admission`` (``admission.py``): what a delivered task becomes (dead letter, error result,
  done before, or a held task);
- the verdict on each task (``verdicts.decide``), carried out by the source's settler;
- ``Claims`` (``claims.py``): what is held, the room left, the keep-alive;
- ``Batches`` (``batches.py``): batch formation and dispatch to the engine thread;
- ``BatchObserver`` (``health/observer.py``): liveness, metrics and guards after each batch.

How the process ends is a value (``Exit``), decided here.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import structlog

from config.derived import chosen_device, max_held_tasks
from config.errors import DeviceFailed, Failure, LoaderGaveUp
from config.settings import Settings
from worker.core.admission import Admission
from worker.core.availability import Availability, retry_loads, tell_loaded
from worker.core.batches import CANCELLED_SETTLES_WAIT_S, GIVE_BACK_WAIT_S, Batches
from worker.core.claims import Claim, Claims, best_effort
from worker.core.dropping import InactiveJobDrops
from worker.core.exits import STOPPED, Exit, ExitReason
from worker.core.link import Helper, SourceLink
from worker.core.loading import Loads
from worker.core.outcome import Outcome
from worker.core.ports import BatchEngine, BatchReport, Delivered
from worker.core.results import ResultMaker
from worker.core.settling import Settling
from worker.core.verdicts import Decision, Verdict, decide
from worker.health.liveness import Liveness
from worker.health.metrics import Metrics
from worker.health.observer import BatchObserver

log = structlog.get_logger(__name__)
_FIRST_FETCH_BACKOFF_S = 1.0  # a fetch that raised: tried again after this, doubling
_MAX_FETCH_BACKOFF_S = 30.0
_BURST_FAILED_FETCHES = 5  # in a row, with --until-idle: the run ends NOT_SERVED (exit 6)
# Loads of one pipeline that failed, with --until-idle: the run ends NOT_SERVED (exit 6) rather
# than wait on its file host for ever (its tasks are given back for another host).
_BURST_LOAD_TRIES = 3
_BLOCKED_TICK_S = 1.0
_LOAD_TICK_S = 5.0  # while a model loads: progress noted, held tasks kept alive
_DRAIN_TICK_S = 0.05  # how often a drain that finishes the held tasks looks again
# A cancelled processor ends once its settles have given back (``CANCELLED_SETTLES_WAIT_S`` at
# most); a second more, then the drain goes on without it.
_PROCESSOR_END_S = CANCELLED_SETTLES_WAIT_S + 1.0
_LEFT_FOR_ACK_WAIT = (
    "exiting without them: they come back after their ack wait (NATS) or their "
    "reservation's TTR (Antenna)"
)


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
    image_bytes: int = 3 * 224 * 224  # the most host bytes one loaded image can take
    # Which pipelines cannot be loaded on this host now, and when each is tried again.
    availability: Availability = field(default_factory=Availability)


class Orchestrator:
    def __init__(self, settings: Settings, services: Services, *, until_idle: bool = False):
        self.settings = settings
        self.services = services
        self.settling = Settling(services.link.settler, services.metrics, services.link.kind)
        self.claims = Claims(
            max_held_tasks(settings, services.image_bytes),
            services.liveness,
            self.settling,
            lambda pipeline: not services.availability.available(pipeline),
            settings.loader.batch_size,  # held for unavailable pipelines outside the room
        )
        self.link = services.link
        self.results = ResultMaker(services.link.model_of)
        self.availability = available = services.availability
        self.admission = Admission(
            self.settling,
            services.link.results,
            self.claims,
            self.results,
            available.available,
            services.link.backoff,
            services.link.extends_leases,
            available.retry_in_s,
        )
        observer = BatchObserver(
            services.metrics,
            services.liveness,
            services.guard or (lambda: None),
            lambda reason: self._end(Exit(ExitReason.RESOURCE_LIMIT, reason), log_as="limit"),
        )
        self.batches = Batches(
            settings.loader.batch_size,
            services.engine,
            services.engine_thread,
            lambda batch, report: observer.batch_done(len(batch), report, batch[0].task.pipeline),
            self._settle_batch,
            prepare=self._prepare,
            hold_per_load=settings.model.hold_per_load,
            on_device_failed=self._device_failed,
            availability=available,
            holds_last=services.link.extends_leases,
        )
        self._drops = InactiveJobDrops(
            services.link.inactive_jobs, self.batches, self.claims, services.metrics
        )
        self._until_idle = until_idle
        self._batch_s: deque[float] = deque(maxlen=5)  # the last batches' load + infer + store
        self._stop = asyncio.Event()
        self.exit: Exit = STOPPED  # how the process ends; the first reason to stop wins
        self._drain_by = float("inf")  # time.monotonic() by which a stop must be drained

    async def run(self, stop: asyncio.Event) -> Exit:
        """Work until ``stop`` is set or a part fails, then drain: finish the batch in hand,
        give back the rest. Returns how the process should end."""
        self._stop = asyncio.Event()  # ours: set by a stop, a failure, a limit, burst mode
        fetcher = asyncio.create_task(self._fetch_loop(), name="fetch-loop")
        processor = asyncio.create_task(self.batches.run(), name="process-loop")
        processor.add_done_callback(self._processor_ended)  # a failed device: said at once
        stopped = asyncio.create_task(stop.wait(), name="stop-wait")
        halted = asyncio.create_task(self._stop.wait(), name="halt-wait")
        helpers = [asyncio.create_task(self._watch_gone(), name="source-watch")]
        helpers.append(asyncio.create_task(self._retry_loads(), name="load-retry"))
        if self.link.results_waiting is not None:
            helpers.append(asyncio.create_task(self._note_blocked(), name="blocked-watch"))
        helpers += [
            asyncio.create_task(run(self._stop), name=name)
            for name, run in (*self.link.helpers, *self.services.helpers)
        ]
        if self._until_idle:
            helpers.append(asyncio.create_task(self._stop_when_idle(), name="until-idle"))
        try:
            await asyncio.wait(
                {fetcher, processor, stopped, halted, *helpers},
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            self._stop.set()  # the caller's event stays theirs (a second signal means "now")
            self._drain_by = time.monotonic() + self.settings.health.drain_timeout_s
            # The watchdog's window starts over: the drain timeout is shorter than it (a
            # settings rule), and a drain that makes progress feeds it (``_drain``).
            self.services.liveness.still_working()
            await self._let_fetch_finish(fetcher)
            for helper in [stopped, halted, *helpers]:
                helper.cancel()
            await asyncio.gather(stopped, halted, *helpers, return_exceptions=True)
            await self._drain(processor)
        for task in (fetcher, processor, *helpers):
            if task.done() and not task.cancelled() and task.exception() is not None:
                self._failed(task.get_name(), task.exception())
        return self.exit

    # -- the loops ----------------------------------------------------------------------
    async def _fetch_loop(self) -> None:
        timeout_s = self.link.fetch_wait_s
        backoff_s = _FIRST_FETCH_BACKOFF_S
        failed = 0  # fetches in a row that raised
        while not self._stop.is_set():
            await self._drops.drop()  # also while no room: a full cap is the common case
            room = self.claims.room()
            if room <= 0:
                await self.claims.wait_for_room(timeout_s)
                continue
            try:
                deliveries = await self.link.source.fetch(
                    min(self.settings.loader.batch_size, room),
                    self.batches.runnable,
                    self.availability.available,
                )
            except Exception as error:  # the source's boundary: never the process
                failed += 1
                log.error(
                    "fetch_failed",
                    error=f"{type(error).__name__}: {error}",
                    failed_in_a_row=failed,
                    retry_in_s=backoff_s,
                    exc_info=error,
                )
                if self._until_idle and failed >= _BURST_FAILED_FETCHES:
                    self._fetch_keeps_failing(failed, error)
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), backoff_s)
                backoff_s = min(backoff_s * 2, _MAX_FETCH_BACKOFF_S)
                continue
            backoff_s, failed = _FIRST_FETCH_BACKOFF_S, 0
            # Concurrently: each asks the results stream whether its task is done already.
            admitted = await asyncio.gather(*map(self.admission.admit, deliveries))
            self.batches.add([claim for claim in admitted if claim])

    def _fetch_keeps_failing(self, failed: int, error: Exception) -> None:
        """Burst mode: a source that raises on every fetch never becomes idle, so the run
        would never end; after ``_BURST_FAILED_FETCHES`` in a row it ends NOT_SERVED."""
        why = f"the task source failed {failed} fetches in a row: {type(error).__name__}: {error}"
        log.error("idle_not_served", reason=why, exit_code=ExitReason.NOT_SERVED.code)
        self._end(Exit(ExitReason.NOT_SERVED, why))

    async def _let_fetch_finish(self, fetcher: asyncio.Task[None]) -> None:
        """Cancelling a fetch in flight would strand the messages the server already
        delivered to us until their ack wait runs out. A source whose give-back costs
        (``finish_held_on_stop``: an Antenna reservation is answered whenever its server
        answers, and what it reserved is lost to the TTR) is waited for as long as the drain
        allows, so what it delivers is run or given back with its line; what is still in
        flight then is cancelled, and the source says what it leaves."""
        wait_s = self._drain_left_s()
        if not self.link.finish_held_on_stop:
            wait_s = min(self.link.fetch_wait_s + 5, wait_s)
        try:
            await asyncio.wait_for(asyncio.shield(fetcher), wait_s)
        except Exception:  # noqa: BLE001 - a timeout, or a failure reported by run()
            fetcher.cancel()
            await asyncio.gather(fetcher, return_exceptions=True)

    def _drain_left_s(self) -> float:
        """What is left of the drain timeout since the stop (the fetch in flight, then the
        batch in hand, share it)."""
        return max(0.0, self._drain_by - time.monotonic())

    @functools.cached_property
    def _loads(self) -> Loads:
        """Each load bounded by WORKER_MODEL__LOAD_DEADLINE_S; a wedged one asks for a restart."""
        s = self.services
        return Loads(s.engine.load, self.settings.model.load_deadline_s, s.liveness.must_restart)

    async def _prepare(self, pipeline: str) -> Failure | None:
        """``pipeline``'s models ready for its next batch: loaded on a thread of their own
        when they are not. Meanwhile, up to the load deadline (``Loads``), the worker counts
        as progressing and the held tasks' ack waits are extended; past it the load fails
        (``load_timeout``) and its pipeline is unavailable. The failure its tasks get when the
        models cannot be had."""
        if self.services.engine.ready(pipeline):
            return None

        async def tick() -> None:
            self.services.liveness.loading()
            await self.claims.keep_alive()

        tick_s = min(_LOAD_TICK_S, self.link.keepalive_tick_s)
        failure = await self._loads.load(pipeline, tick, tick_s)
        if failure is None and self.services.loaded is not None:
            await self.services.loaded(pipeline)
        return failure

    async def _retry_loads(self) -> None:
        """The loads of unavailable pipelines tried again in the background, each on a thread
        of its own (never the event loop, never a batch's wait); meanwhile the tasks held for
        them (on their last delivery) are kept alive, and while they are all that is held the
        worker counts as loading, not stalled."""

        async def load(pipeline: str) -> Failure | None:
            failure = await self._loads.load(pipeline)  # bounded; no second thread
            if failure is None and self.services.loaded is not None:
                await tell_loaded(self.services.loaded, pipeline)
            return failure

        async def tick() -> None:
            waiting = [
                h for h in self.claims.all() if not self.availability.available(h.task.pipeline)
            ]
            for held in waiting:
                await best_effort(self.settling.keep_alive(held.delivered))
            if waiting and len(waiting) == len(self.claims) and not self.batches.engine_busy():
                self.services.liveness.loading()

        tick_s = min(_LOAD_TICK_S, self.link.keepalive_tick_s)
        await retry_loads(self.availability, load, self._stop, tick, tick_s)

    async def _settle_batch(self, batch: list[Claim], report: BatchReport) -> None:
        self.claims.inferred(batch)  # their images are gone: the next batch may be fetched
        started = time.perf_counter()
        await asyncio.gather(*(self._settle_one(h, report.outcomes[h.key]) for h in batch))
        store_s = time.perf_counter() - started
        self.services.metrics.observe_stage("store", batch[0].task.pipeline, store_s)
        self._batch_s.append(report.load_s + report.infer_s + store_s)
        await self.claims.keep_alive()

    async def _settle_one(self, held: Claim, outcome: Outcome) -> None:
        total_s = time.monotonic() - held.fetched_at
        timings_s = {**outcome.timings_s, "total_s": total_s}
        timed = Outcome(outcome.detections, outcome.failure, timings_s)
        delivered = held.delivered
        try:
            verdict = decide(
                held.task,
                timed,
                delivered=delivered.delivered,
                deliveries_left=delivered.deliveries_left,
                results=self.results,
                backoff=self.link.backoff,
                not_before_s=self.availability.retry_in_s(held.task.pipeline),
            )
            await self.settling.settle(delivered, verdict)
        except asyncio.CancelledError:  # the drain's time ran out: given back, never stranded
            why = "the drain ended before its result was stored"
            await self._give_back_within([held], why)
            raise
        except Exception:  # the per-task boundary: logged; its ack wait brings it back
            log.exception("settle_failed", task_id=held.task.id, job_id=held.task.job_id)
        finally:
            self.claims.release([held])
            if self._stop.is_set():
                self.services.liveness.still_working()  # a drain that settles is working

    # -- why we stop ----------------------------------------------------------------------
    def _end(self, exit: Exit, log_as: str = "") -> None:
        """Stop working, for ``exit``; the first reason recorded is the one reported."""
        if self.exit == STOPPED:
            self.exit = exit
            if log_as == "limit":
                log.error(
                    "resource_limit_exceeded",
                    reason=exit.detail,
                    action="finishing this batch, giving back the rest, exiting 4",
                )
        self._stop.set()

    def _failed(self, part: str, error: BaseException | None) -> None:
        if isinstance(error, DeviceFailed):
            self._device_failed(error)  # said when it happened (``_processor_ended``)
            return
        if isinstance(error, LoaderGaveUp):
            log.error("exiting_for_a_restart", reason=str(error), exit_code=3)
            self._end(Exit(ExitReason.LOADER_FAILING, str(error)))
            return
        log.error("worker_part_failed", part=part, exc_info=error, exit_code=1)
        self._end(Exit(ExitReason.FAILED, f"{part} failed: {type(error).__name__}: {error}"))

    def _processor_ended(self, processor: asyncio.Task[None]) -> None:
        error = None if processor.cancelled() else processor.exception()
        if isinstance(error, DeviceFailed):
            self._device_failed(error)

    def _device_failed(self, error: DeviceFailed) -> None:
        """The device failed for good: no batch can run on it again, and no task is to blame.
        Said once, the moment the engine raised: /healthz answers ``restart`` and one error
        line names the error and the device; then the drain gives back every held task, the
        failed batch's too (no result is stored for them), without running another batch,
        and the process exits 7, over any other reason to stop that came first (a SIGTERM's
        drain, a crossed limit): a new process gets a new CUDA context."""
        if self.exit.reason is ExitReason.DEVICE_FAILED:
            return
        device = chosen_device(self.settings)
        self.services.liveness.must_restart(f"device {device} failed: {error}")
        log.error(
            "device_failed",
            error=str(error),
            device=device,
            held=len(self.claims),
            exit_code=ExitReason.DEVICE_FAILED.code,
            action="giving back every held task, exiting for a new process",
        )
        self.exit = Exit(ExitReason.DEVICE_FAILED, f"device {device} failed: {error}")
        self._stop.set()

    async def _watch_gone(self) -> None:
        """A source gone for good gives nothing ever again: end the process (exit 5)."""
        if self.link.gone is None:
            await asyncio.Event().wait()
            return
        await self.link.gone.wait()
        self._end(Exit(ExitReason.SOURCE_GONE, self.link.gone_reason))

    async def _note_blocked(self) -> None:
        """While the engine is idle and finished results wait for the source's server, the
        worker is blocked on it, not wedged: the stall clock and the watchdog start over
        every ``_BLOCKED_TICK_S`` (docs/operating.md, timing budget). A frozen event loop ticks no
        more and a batch stuck in the engine keeps it busy, so either is still replaced."""
        waiting = self.link.results_waiting
        assert waiting is not None
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), _BLOCKED_TICK_S)
            if len(self.claims) and waiting() and not self.batches.engine_busy():
                self.services.liveness.waiting_on_source()

    async def _stop_when_idle(self) -> None:
        """Burst mode: stop once nothing is held and the consumers have nothing pending, seen
        twice in a row (an advisory is stored a moment after its task leaves the consumer); or
        end NOT_SERVED, held tasks or not, once the source says it has given up
        (``SourceLink.given_up``) or a pipeline failed ``_BURST_LOAD_TRIES`` loads."""
        idle_before = False
        while not self._stop.is_set():
            await asyncio.sleep(self.link.fetch_wait_s)
            given_up = self.link.given_up() or self.availability.given_up(_BURST_LOAD_TRIES)
            if given_up is not None:  # its held tasks are given back by the drain
                log.error("idle_not_served", reason=given_up, exit_code=ExitReason.NOT_SERVED.code)
                self._end(Exit(ExitReason.NOT_SERVED, given_up))
                return
            idle = len(self.claims) == 0 and await self.link.source.idle() and len(self.claims) == 0
            if idle and idle_before:
                self._stop_idle()
            idle_before = idle

    def _stop_idle(self) -> None:
        why = self.link.unserved()
        if why is None:
            log.info("idle_stopping", reason="--until-idle: nothing pending or held")
            self._stop.set()
            return
        log.error("idle_not_served", reason=why, exit_code=ExitReason.NOT_SERVED.code)
        self._end(Exit(ExitReason.NOT_SERVED, why))

    # -- shutdown ---------------------------------------------------------------------------
    async def _finish_held(self, processor: asyncio.Task[None], deadline: float) -> None:
        """Let the batches run while tasks wait and the time left holds the batch in hand and
        one more (each as long as the longest of the last five, or, before any, as long as the
        drain has run so far: the batch in hand has taken that at least)."""
        started = time.monotonic()
        held = len(self.batches.waiting())
        while self.batches.waiting() and not processor.done():
            now = time.monotonic()
            batch_s = max(self._batch_s, default=now - started)
            if deadline - now < 2 * batch_s:
                log.info(
                    "drain_giving_back",
                    waiting=len(self.batches.waiting()),
                    seconds_left=round(deadline - now, 2),
                    batch_s=round(batch_s, 3),
                )
                return
            await asyncio.sleep(min(_DRAIN_TICK_S, max(deadline - now, 0.0)))
        if held and not self.batches.waiting():
            left_s = round(deadline - time.monotonic(), 2)
            log.info("drain_finished_held", tasks=held, seconds_left=left_s)

    async def _drain(self, processor: asyncio.Task[None]) -> None:
        """Finish the batch in hand within the drain timeout; give back everything else now
        (with ``finish_held_on_stop``: run the held tasks' batches first, while the drain time
        allows one more, and give back only what is left)."""
        leftovers = await self.link.source.close()
        self.services.liveness.still_working()
        deadline = self._drain_by  # the drain timeout counts from the stop
        if self.link.finish_held_on_stop:
            await self._finish_held(processor, deadline)
        # Each bounded wait from here may begin past the drain's timeout: each gets a fresh
        # watchdog window (the start-up rule: the watchdog outlasts the longest of them).
        self.services.liveness.still_working()
        await self._give_back_within(self.batches.stop(), "shutting down")
        self.services.liveness.still_working()
        await self._give_back_leftovers(leftovers)
        self.services.liveness.still_working()
        if not (await asyncio.wait({processor}, timeout=max(self._drain_left_s(), 0.1)))[0]:
            log.error(
                "drain_timeout",
                held=len(self.claims),
                action="giving back every held task whose result is not stored and acked",
            )
            # The batches' run passes the cancel on to the settles in flight; each gives back
            # at once what it has not acked: a nak, a local note, but one that can hang on a
            # hung connection, so each give-back and the wait for the run are bounded.
            self.services.liveness.still_working()  # the drain's timeout is reached
            processor.cancel()
            if not (await asyncio.wait({processor}, timeout=_PROCESSOR_END_S))[0]:
                log.error(
                    "drain_processor_stuck",
                    waited_s=_PROCESSOR_END_S,
                    held=len(self.claims),
                    action="giving back what is held and exiting without waiting for it",
                )
        self.services.liveness.still_working()  # the cancelled run's wait is over
        rest = self.claims.all()
        self.batches.forget(rest)
        await self._give_back_within(rest, "not finished before exit")

    async def _give_back_leftovers(self, leftovers: Sequence[Delivered[Any]]) -> None:
        """What arrived after the last fetch, given back, in ``GIVE_BACK_WAIT_S`` at most."""
        if not leftovers:
            return
        why = "delivered after the last fetch"
        try:
            async with asyncio.timeout(GIVE_BACK_WAIT_S):
                for delivered in leftovers:
                    verdict = Verdict(Decision.GIVE_BACK, reason=why)
                    await self.settling.settle(delivered, verdict)
            log.info("tasks_given_back", count=len(leftovers), reason=why)
        except TimeoutError:
            log.error(
                "drain_give_back_stuck",
                count=len(leftovers),
                reason=why,
                waited_s=GIVE_BACK_WAIT_S,
                action=_LEFT_FOR_ACK_WAIT,
            )

    async def _give_back_within(self, held: list[Claim], reason: str) -> None:
        """``held`` given back (``Claims.give_back``), in ``GIVE_BACK_WAIT_S`` at most: a nak
        can hang on a hung connection, and a drain must end. When it did not end, its tasks are
        named (the first ones may have been given back) and released; the others come back
        after their ack wait (or their reservation's TTR)."""
        try:
            await asyncio.wait_for(self.claims.give_back(held, reason), GIVE_BACK_WAIT_S)
        except TimeoutError:
            ids = [h.task.id for h in held]
            log.error(
                "drain_give_back_stuck",
                count=len(held),
                task_ids=ids,
                reason=reason,
                waited_s=GIVE_BACK_WAIT_S,
                action=_LEFT_FOR_ACK_WAIT,
            )
            self.claims.release(held)
