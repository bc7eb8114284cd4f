"""Batch formation and dispatch.

Batches form when the engine thread is free, from every admitted task not yet in a batch
(up to ``batch_size``), not from what one fetch happened to return: tasks trickling in while
a job is published would otherwise lock the worker into batches of one or two. Which tasks:
the fair share across jobs (``fairshare.FairQueue``); a batch never mixes pipelines. Before a
pipeline's batch runs, its models are made ready (``prepare``: loaded off the event loop when
they are not). A pipeline whose models cannot be loaded is unavailable (``availability``): the
batch that met it and its waiting tasks are given back (the verdict's), but for those on their
last delivery, which wait here for the pipeline to load again; no batch of it forms meanwhile.
A task that names a pipeline not served gets that failure.
While one batch runs on the engine thread, the ones before it are settled on the event loop,
up to ``SETTLES_IN_FLIGHT`` at once: a settle that takes longer than a batch (an Antenna result
post is a WAN's round trip, after its gather) would otherwise leave the engine idle after every
batch. The engine waits only when that many settles are still in flight.

A model switch is paid for (``_Hold``): after a pipeline's models load, batches of pipelines
whose models are not loaded wait until it has run for ``hold_per_load`` times its load time
(at most ``MAX_HOLD_S``) or has nothing waiting, so jobs of more pipelines than the memory
budget holds do not load a model per batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Collection, Coroutine, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import structlog

from config.errors import DeviceFailed, Failure
from worker.core.availability import Availability, is_unavailable, may_give_back
from worker.core.claims import GIVE_BACK_WAIT_S, LEFT_FOR_ACK_WAIT, Claim
from worker.core.fairshare import FairQueue, JobKey
from worker.core.outcome import Outcome
from worker.core.ports import BatchEngine, BatchReport

# Settles a batch run: each task acked with its result stored, or given back. Cancelled (the
# drain's time ran out), it gives back at once every task it has not acked, then ends.
SettleBatch = Callable[[list[Claim], BatchReport], Coroutine[Any, Any, None]]
Prepare = Callable[[str], Coroutine[Any, Any, Failure | None]]
MAX_HOLD_S = 30.0  # the longest a load keeps other unloaded pipelines waiting
SWITCH_WAIT_S = 0.25  # under a hold, how long the engine waits for runnable tasks to arrive
SETTLES_IN_FLIGHT = 2  # batches being settled at once; the next one then waits for the oldest
# How long a cancelled run waits for its settles to give back (each bounded by
# ``claims.GIVE_BACK_WAIT_S``): their bound and a second more.
CANCELLED_SETTLES_WAIT_S = GIVE_BACK_WAIT_S + 1.0

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class _Hold:
    """The pipeline loaded last, and until when other pipelines that need a load wait."""

    pipeline: str
    until_s: float


async def _always_ready(_pipeline: str) -> Failure | None:
    return None


async def _settled(settling: dict[asyncio.Task[None], list[Claim]], *, cancel: bool) -> None:
    """Every settle in ``settling`` ended. Cancelled (``cancel``, or a cancel meanwhile: the
    drain's time ran out), they are cancelled too and waited out for at most
    ``CANCELLED_SETTLES_WAIT_S``: each gives back what it has not acked, so no task is left
    neither acked nor given back, unless its give-back hangs (then it is named, and left for
    its ack wait). A cancel meanwhile is raised afterwards."""
    try:
        if settling and not cancel:
            await asyncio.wait(settling)
    except asyncio.CancelledError:
        cancel = True
        raise
    finally:
        if cancel and settling:
            await _given_back(settling)


async def _given_back(settling: dict[asyncio.Task[None], list[Claim]]) -> None:
    for task in settling:
        task.cancel()
    _, stuck = await asyncio.wait(settling, timeout=CANCELLED_SETTLES_WAIT_S)
    if stuck:
        ids = [held.task.id for task in stuck for held in settling[task]]
        log.error(
            "drain_settles_stuck",
            count=len(ids),
            task_ids=ids,
            waited_s=CANCELLED_SETTLES_WAIT_S,
            action=LEFT_FOR_ACK_WAIT,
        )


def _forget_ended(settling: dict[asyncio.Task[None], list[Claim]]) -> None:
    """The settles that ended, out of ``settling``; the first that raised ends the run, as a
    settle's error did when settles were awaited in turn (the process exits 1, and its drain
    gives back what is held)."""
    ended = [task for task in settling if task.done()]
    for task in ended:
        del settling[task]
    if (failure := _failure(ended)) is not None:
        raise failure


def _report_failure(batch: list[Claim], task: asyncio.Task[None]) -> None:
    """A settle that raised (past its per-task boundary: a bug) is said at once, naming its
    tasks; retrieved here, its error is never asyncio's "Task exception was never retrieved"."""
    if task.cancelled() or (error := task.exception()) is None:
        return
    log.error(  # the traceback comes with worker_part_failed, once the run ends on it
        "batch_settle_failed",
        error=f"{type(error).__name__}: {error}",
        task_ids=[held.task.id for held in batch],
    )


def _failure(settles: Iterable[asyncio.Task[None]]) -> BaseException | None:
    """The error of the first of ``settles`` that ended raising one."""
    for task in settles:
        if task.done() and not task.cancelled() and task.exception() is not None:
            return task.exception()
    return None


class Batches:
    def __init__(
        self,
        batch_size: int,
        engine: BatchEngine,
        engine_thread: Executor,
        on_batch: Callable[[list[Claim], BatchReport], None],
        settle: SettleBatch,
        prepare: Prepare = _always_ready,
        weight: Callable[[JobKey], float] = lambda _key: 1.0,
        hold_per_load: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        on_device_failed: Callable[[DeviceFailed], None] = lambda _failed: None,
        availability: Availability | None = None,
        holds_last: bool = True,
    ) -> None:
        self._batch_size = batch_size
        self._engine = engine
        self._engine_thread = engine_thread
        self._on_batch = on_batch
        self._settle = settle
        self._prepare = prepare
        self._waiting: FairQueue[Claim] = FairQueue(weight)  # admitted, not in a batch
        self._arrived = asyncio.Event()
        self._stopped = False
        self._hold_per_load = hold_per_load
        self._clock = clock
        self._on_device_failed = on_device_failed  # said before the settles in flight end
        self._hold: _Hold | None = None
        self._in_engine: asyncio.Future[BatchReport] | None = None
        self._availability = availability or Availability()
        self._holds_last = holds_last  # last deliveries held (the source extends leases)
        self._strays: list[Claim] = []  # to give back: their pipeline was lost as they came
        self._availability.watch(self._arrived.set)  # a pipeline back: its tasks may run

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, admitted: list[Claim]) -> None:
        """Start loading ``admitted`` now; they join the next batches."""
        if not admitted:
            return
        by_pipeline: dict[str, list[Claim]] = {}
        for held in admitted:
            by_pipeline.setdefault(held.task.pipeline, []).append(held)
        for pipeline, claims in by_pipeline.items():
            self._engine.submit([(h.key, h.task.image_url) for h in claims], pipeline)
        for held in admitted:
            if self._stray(held):  # admitted while its pipeline was being found unavailable
                self._strays.append(held)
            else:
                self._waiting.add((held.task.pipeline, held.task.job_id), held)
        self._arrived.set()

    def _stray(self, held: Claim) -> bool:
        """A task of an unavailable pipeline that may be given back (``may_give_back``)."""
        available = self._availability.available(held.task.pipeline)
        return not available and self._gives_back(held)

    def _gives_back(self, held: Claim) -> bool:
        return may_give_back(held.delivered.deliveries_left, self._holds_last)

    def waiting(self) -> list[Claim]:
        """The waiting tasks a batch may take (not those of an unavailable pipeline)."""
        return [h for h in self._waiting if self._availability.available(h.task.pipeline)]

    def stop(self) -> list[Claim]:
        """No new batches after the one in hand; return the tasks that will not run."""
        left, self._strays = self._waiting.take_all() + self._strays, []
        self._engine.forget([h.key for h in left])
        self._stopped = True
        self._arrived.set()
        return left

    def engine_busy(self) -> bool:
        """A batch is on the engine thread and has not returned."""
        return self._in_engine is not None and not self._in_engine.done()

    def take_jobs(self, job_ids: Collection[str]) -> list[Claim]:
        """The waiting tasks of ``job_ids``, out of the batches to come, their loads dropped."""
        taken = self._waiting.take_jobs(job_ids)
        self._engine.forget([h.key for h in taken])
        return taken

    def forget(self, held: list[Claim]) -> None:
        self._engine.forget([h.key for h in held])

    async def run(self) -> None:
        """Form and run batches until ``stop``; the settling of every batch run is awaited.

        A cancel (the drain's time ran out) never leaves a settle half-way: it is passed on to
        every settle in flight, each of which gives back at once the tasks it has not acked
        (``SettleBatch``'s contract), and the run ends once they have, or once
        ``CANCELLED_SETTLES_WAIT_S`` has passed. A settle that raised ends the run with its
        error (after the settles in flight), once it is seen: when the next batch is handed
        over, or at the end."""
        settling: dict[asyncio.Task[None], list[Claim]] = {}  # in the order they started

        async def settle(batch: list[Claim], report: BatchReport) -> None:
            while len(settling) >= SETTLES_IN_FLIGHT:
                await asyncio.wait({next(iter(settling))})  # a cancel here is not the settle's
                _forget_ended(settling)
            _forget_ended(settling)
            task = asyncio.create_task(self._settle(batch, report))
            task.add_done_callback(functools.partial(_report_failure, batch))
            settling[task] = batch

        cancelled = False
        try:
            await self._dispatch(settle)
        except DeviceFailed as failed:
            self._on_device_failed(failed)  # stop fetching now, not once the settles end
            raise
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            await _settled(settling, cancel=cancelled)
        if (failure := _failure(settling)) is not None:
            raise failure

    async def _dispatch(self, settle: SettleBatch) -> None:
        """Run the batches until ``stop``, each one's report handed to ``settle``."""
        loop = asyncio.get_running_loop()
        while batch := await self._next_batch():
            pipeline = batch[0].task.pipeline
            failure = self._availability.failure(pipeline) or await self._prepared(pipeline)
            if is_unavailable(failure):
                await self._set_aside(pipeline, batch, failure, settle)
                continue
            if failure is not None:
                batch += self._waiting.take_pipeline(pipeline)
                self._engine.forget([h.key for h in batch])
                report = BatchReport({h.key: Outcome(failure=failure) for h in batch}, 0, 0, 0)
                await settle(batch, report)
                continue
            keys = [h.key for h in batch]
            running = loop.run_in_executor(
                self._engine_thread, self._engine.run_batch, keys, pipeline
            )
            self._in_engine = running
            report = await running
            failed = next((o.failure for o in report.outcomes.values() if o.failure), None)
            if is_unavailable(failed):  # unloaded since it was prepared, and not loaded again
                await self._set_aside(pipeline, batch, failed, settle)
                continue
            self._on_batch(batch, report)
            await settle(batch, report)

    async def _set_aside(
        self, pipeline: str, batch: list[Claim], failure: Failure | None, settle: SettleBatch
    ) -> None:
        """``pipeline`` cannot be loaded: unavailable from now; ``batch`` and its waiting tasks
        given back (the verdict's), but those on their last delivery where the source extends
        leases (a give-back would end them as a final error), which wait, held, until it loads
        again or the drain."""
        assert failure is not None
        self._availability.lost(pipeline, failure)
        batch += self._waiting.take_pipeline(pipeline)
        self._engine.forget([h.key for h in batch])
        last = [h for h in batch if not self._gives_back(h)]
        back = [h for h in batch if self._gives_back(h)]
        self.add(last)  # their images loaded again, for when it is back
        if not back:
            return
        log.warning(
            "tasks_given_back",
            count=len(back),
            pipeline=pipeline,
            reason=f"pipeline {pipeline!r} is unavailable on this host",
            kept_held=len(last),
            task_ids=[h.task.id for h in back],
        )
        report = BatchReport({h.key: Outcome(failure=failure) for h in back}, 0, 0, 0)
        await settle(back, report)

    async def _prepared(self, pipeline: str) -> Failure | None:
        """``prepare``; a load that happened starts a hold for ``pipeline``."""
        if self._engine.ready(pipeline) or self._hold_per_load <= 0:
            return await self._prepare(pipeline)
        started_s = self._clock()
        failure = await self._prepare(pipeline)
        if failure is None:
            now_s = self._clock()
            held_s = min(self._hold_per_load * (now_s - started_s), MAX_HOLD_S)
            self._hold = _Hold(pipeline, now_s + held_s)
        return failure

    def _holding(self) -> bool:
        return self._hold is not None and self._clock() < self._hold.until_s

    def runnable(self, pipeline: str) -> bool:
        """Whether a batch of ``pipeline`` may run now: the hold, if one is on, keeps out
        pipelines that would need a load. The sources fetch from such pipelines' jobs first
        (``TaskSource.fetch``), or the held room would fill with tasks that must wait."""
        hold = self._hold
        if hold is None or self._clock() >= hold.until_s or pipeline == hold.pipeline:
            return True
        return self._engine.ready(pipeline)

    async def _next_batch(self) -> list[Claim]:
        """The fair share's next batch, once a task waits; [] to stop. Under a hold, the
        fairest job that needs no load; any, when only such jobs wait (after waiting up to
        ``SWITCH_WAIT_S`` for runnable tasks: the held pipeline's next ones may be arriving).
        Never one of an unavailable pipeline."""
        available = self._availability.available
        usable = lambda pipeline: available(pipeline) and self.runnable(pipeline)  # noqa: E731
        while not self._stopped:
            if self._strays:
                stray = self._strays[0].task.pipeline
                batch = [h for h in self._strays if h.task.pipeline == stray]
                self._strays = [h for h in self._strays if h.task.pipeline != stray]
                return batch
            batch = self._waiting.next_batch(self._batch_size, usable)
            if not batch and len(self._waiting) and self._holding():
                self._arrived.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._arrived.wait(), SWITCH_WAIT_S)
                batch = self._waiting.next_batch(self._batch_size, usable)
            batch = batch or self._waiting.next_batch(self._batch_size, available)
            if batch:
                return batch
            self._arrived.clear()
            await self._arrived.wait()
        return []
