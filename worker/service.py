"""The orchestrator: fetch tasks, feed the loader, run batches on the engine thread, settle.

The event loop only orchestrates; loader iteration and forward passes run on the engine's
dedicated thread. At most ``batch_size * prefetch_batches`` tasks are held at once.

Batches are formed when the engine is free, from every admitted task not yet in a batch (up
to ``batch_size``), not from what one fetch happened to return: tasks trickling in while a
job is published would otherwise lock the worker into batches of one or two.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import nats
import structlog
from nats.aio.msg import Msg

from config.settings import Settings, max_held_tasks
from datasets.loader import LoadRequest
from worker.advisories import ExhaustedTasks
from worker.engine import BatchReport, Engine, LoaderGaveUp
from worker.exits import STOPPED, Exit, ExitReason
from worker.guards import ResourceGuard
from worker.health import Liveness, Metrics
from worker.results import ResultStore, ResultsUnavailable
from worker.schemas import InvalidTask, Task, Undeliverable, Verdict, parse_task
from worker.settle import Held, Settler
from worker.transport import ConnectionState, TaskFeed

log = structlog.get_logger(__name__)


@dataclass
class Services:
    """What the orchestrator talks to; built by the wiring module."""

    feed: TaskFeed
    store: ResultStore
    settler: Settler
    engine: Engine
    engine_thread: ThreadPoolExecutor
    liveness: Liveness
    metrics: Metrics
    exhausted: ExhaustedTasks | None = None
    guard: ResourceGuard | None = None
    connection: ConnectionState | None = None


class Worker:
    def __init__(self, settings: Settings, services: Services) -> None:
        self.settings = settings
        self.s = services
        self.held: dict[int, Held] = {}
        self._keys = itertools.count()
        self._waiting: asyncio.Queue[Held | None] = asyncio.Queue()  # admitted, not in a batch
        self._space = asyncio.Event()
        self._max_held = max_held_tasks(settings)
        self._stop = asyncio.Event()
        self.exit: Exit = STOPPED  # how the process ends; the first reason to stop wins

    # -- the two loops --------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> Exit:
        """Work until ``stop`` is set or a part fails, then drain: finish the batch in hand,
        give back the rest. Returns how the process should end."""
        self._stop = stop
        fetcher = asyncio.create_task(self._fetch_loop(stop), name="fetch-loop")
        processor = asyncio.create_task(self._process_loop(), name="process-loop")
        stopped = asyncio.create_task(stop.wait(), name="stop-wait")
        helpers = []
        if self.s.exhausted is not None:
            helpers.append(asyncio.create_task(self.s.exhausted.run(stop), name="max-deliveries"))
        if self.s.connection is not None:
            helpers.append(asyncio.create_task(self._watch_connection(), name="nats-watch"))
        try:
            await asyncio.wait(
                {fetcher, processor, stopped, *helpers}, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            stopped.cancel()
            # Let a fetch in flight finish: cancelling it would strand the messages the server
            # already delivered to us until their ack wait runs out.
            try:
                await asyncio.wait_for(
                    asyncio.shield(fetcher), self.settings.nats.fetch_timeout_s + 5
                )
            except Exception:  # noqa: BLE001 - a timeout, or a failure reported below
                fetcher.cancel()
            for helper in helpers:
                if not helper.done():
                    helper.cancel()
            await asyncio.gather(fetcher, stopped, *helpers, return_exceptions=True)
            await self._drain(processor)
        for task in (fetcher, processor, *helpers):
            if task.done() and not task.cancelled() and task.exception() is not None:
                self._failed(task.get_name(), task.exception())
        return self.exit

    def _end(self, exit: Exit) -> None:
        """Stop working, for ``exit``; the first reason recorded is the one reported."""
        if self.exit == STOPPED:
            self.exit = exit
        self._stop.set()

    def _failed(self, part: str, error: BaseException | None) -> None:
        if isinstance(error, LoaderGaveUp):
            log.error("exiting_for_a_restart", reason=str(error), exit_code=3)
            self._end(Exit(ExitReason.LOADER_FAILING, str(error)))
            return
        log.error("worker_part_failed", part=part, exc_info=error, exit_code=1)
        self._end(Exit(ExitReason.FAILED, f"{part} failed: {type(error).__name__}: {error}"))

    async def _watch_connection(self) -> None:
        """A NATS client closed for good fetches nothing ever again: end the process."""
        assert self.s.connection is not None
        await self.s.connection.closed.wait()
        if self.s.connection.unexpectedly_closed():
            self._end(Exit(ExitReason.NATS_CLOSED, "the NATS connection closed for good"))

    async def _fetch_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            room = self._max_held - len(self.held)
            if room <= 0:
                self._space.clear()
                try:
                    await asyncio.wait_for(self._space.wait(), self.settings.nats.fetch_timeout_s)
                except TimeoutError:
                    pass
                continue
            msgs = await self.s.feed.fetch(min(self.settings.loader.batch_size, room))
            admitted = [held for held in [await self._admit_safely(msg) for msg in msgs] if held]
            if admitted:
                self.s.engine.submit([LoadRequest(h.key, h.task.image_url) for h in admitted])
                for held in admitted:
                    self._waiting.put_nowait(held)

    async def _process_loop(self) -> None:
        loop = asyncio.get_running_loop()
        settling: asyncio.Task[None] | None = None
        try:
            while True:
                batch = await self._next_batch()
                if not batch:  # drain: no new batches
                    return
                keys = [h.key for h in batch]
                running = loop.run_in_executor(self.s.engine_thread, self.s.engine.run_batch, keys)
                if settling is not None:
                    await settling
                report = await running
                self._batch_done(batch, report)
                settling = asyncio.create_task(self._settle_batch(batch, report))
        finally:
            if settling is not None:
                await asyncio.shield(settling)

    async def _next_batch(self) -> list[Held]:
        """Every waiting task, up to ``batch_size``, once at least one waits; [] to stop."""
        first = await self._waiting.get()
        if first is None:
            return []
        batch = [first]
        while len(batch) < self.settings.loader.batch_size and not self._waiting.empty():
            held = self._waiting.get_nowait()
            if held is None:
                self._waiting.put_nowait(None)  # the next call stops
                break
            batch.append(held)
        return batch

    # -- admission ------------------------------------------------------------------------
    async def _admit_safely(self, msg: Msg) -> Held | None:
        """The per-message boundary of admission: whatever a message holds, a failure to admit
        it is logged and the message given back, never the end of the fetch loop."""
        try:
            return await self._admit(msg)
        except Exception:
            log.exception("admission_failed", subject=msg.subject)
            await _nak_quietly(msg)
            return None

    async def _admit(self, msg: Msg) -> Held | None:
        """Parse a message; settle the ones that need no loading. Returns what must be loaded."""
        delivered = msg.metadata.num_delivered
        try:
            task = parse_task(msg.data)
        except Undeliverable as error:
            await self.s.settler.dead_letter(msg, str(error))
            return None
        except InvalidTask as error:
            task = Task(error.task_id, error.job_id, error.image_id, "")
            verdict = Verdict(error_kind="invalid_task", error_message=str(error))
            await self.s.settler.settle(task, msg, delivered, verdict)
            return None
        if delivered > 1 and await self._already_stored(msg, task.job_id, task.id):
            return None
        held = Held(msg, task, next(self._keys), delivered, time.monotonic())
        self.held[held.key] = held
        self.s.liveness.set_held(len(self.held))
        return held

    async def _already_stored(self, msg: Msg, job_id: str, task_id: str) -> bool:
        """A redelivered task whose result is stored (its ack was lost) is only acked."""
        try:
            stored = await self.s.store.exists(job_id, task_id)
        except ResultsUnavailable:
            return False  # the store refuses duplicates anyway
        if stored:
            await msg.ack()
            log.info("redelivered_task_already_stored", task_id=task_id, job_id=job_id)
        return stored

    # -- after a batch ----------------------------------------------------------------------
    def _batch_done(self, batch: list[Held], report: BatchReport) -> None:
        m = self.s.metrics
        self.s.liveness.batch_completed()
        m.batches.inc()
        m.images.inc(sum(1 for v in report.outcomes.values() if v.ok))
        m.batch_seconds.labels("load").observe(report.load_s)
        m.batch_seconds.labels("infer").observe(report.infer_s)
        if report.loader_restarts:
            m.loader_restarts.inc(report.loader_restarts)
        self._check_guards()
        log.info(
            "batch_done",
            size=len(batch),
            ok=sum(1 for v in report.outcomes.values() if v.ok),
            load_s=round(report.load_s, 4),
            infer_s=round(report.infer_s, 4),
            loader_restarts=report.loader_restarts,
        )

    def _check_guards(self) -> None:
        try:
            reason = self.s.guard.check() if self.s.guard is not None else None
        except Exception:  # a guard that cannot read /proc this time must not stop the work
            log.exception("guard_check_failed", hint="checked again after the next batch")
            return
        if reason and self.exit == STOPPED:
            log.error(
                "resource_limit_exceeded",
                reason=reason,
                action="finishing this batch, giving back the rest, exiting 4",
            )
            self._end(Exit(ExitReason.RESOURCE_LIMIT, reason))

    async def _settle_batch(self, batch: list[Held], report: BatchReport) -> None:
        started = time.perf_counter()
        await asyncio.gather(*(self._settle_one(h, report.outcomes[h.key]) for h in batch))
        self.s.metrics.batch_seconds.labels("store").observe(time.perf_counter() - started)
        await self._keep_alive()

    async def _settle_one(self, held: Held, verdict: Verdict) -> None:
        try:
            total_s = time.monotonic() - held.fetched_at
            timed = Verdict(
                verdict.predictions,
                verdict.error_kind,
                verdict.error_message,
                verdict.retryable,
                {**verdict.timings_s, "total_s": total_s},
            )
            await self.s.settler.settle(held.task, held.msg, held.delivered, timed)
        except Exception:
            log.exception("settle_failed", task_id=held.task.id, job_id=held.task.job_id)
        finally:
            self._release([held])

    async def _keep_alive(self) -> None:
        """A batch completed: extend the ack wait of everything still held, and only then."""
        for held in list(self.held.values()):
            try:
                await held.msg.in_progress()
            except nats.errors.Error:
                pass

    def _release(self, done: list[Held]) -> None:
        for held in done:
            self.held.pop(held.key, None)
        self.s.liveness.set_held(len(self.held))
        self._space.set()

    # -- shutdown ---------------------------------------------------------------------------
    async def _drain(self, processor: asyncio.Task[None]) -> None:
        """Finish the batch in hand within the drain timeout; give back everything else now."""
        leftovers = await self.s.feed.close()
        queued: list[Held] = []
        while not self._waiting.empty():
            held = self._waiting.get_nowait()
            if held is not None:
                queued.append(held)
        await self._give_back(queued, "shutting down")
        for msg in leftovers:
            await _nak_quietly(msg)
        if leftovers:
            log.info(
                "tasks_given_back", count=len(leftovers), reason="delivered after the last fetch"
            )
        self._waiting.put_nowait(None)
        try:
            await asyncio.wait_for(processor, self.settings.health.drain_timeout_s)
        except TimeoutError:
            log.error("drain_timeout", held=len(self.held))
        except Exception:
            log.exception("process_loop_failed")
        await self._give_back(list(self.held.values()), "not finished before exit")

    async def _give_back(self, held: list[Held], reason: str) -> None:
        if not held:
            return
        for h in held:
            await _nak_quietly(h.msg)
        self.s.engine.forget([h.key for h in held])
        self._release(held)
        log.info("tasks_given_back", count=len(held), reason=reason)


async def _nak_quietly(msg: Msg) -> None:
    """Give a message back now; if the connection is gone, its ack wait brings it back."""
    try:
        await msg.nak()
    except nats.errors.Error:
        pass
