"""Job progress for the person who submits it: ``submit --wait`` and ``watch --job J``.

Counts come from the job's own subjects only: its distinct task ids (``tasks.*.<job>``, read
at the start with the stream's get-next-by-subject, no consumer on the tasks stream, and read
on every ``_RECOUNT_EVERY`` refreshes) and its results (``results.<job>.>``, each read once
through one ephemeral consumer, deleted at the end), so a large job costs one pass over its
results, not one per refresh. A result whose id is no task of the job is not counted
(``foreign``); an ``ok`` whose response kept in the object store cannot be read back is no
``ok`` (``response_unreadable``, an error for the exit code). On a terminal the line is a
redrawn bar; otherwise one plain line per interval. No torch here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TextIO

import nats
from nats.js import JetStreamContext, api

from config.settings import NatsSettings
from worker.commands.job_client import JobTasks, read_result, unreadable_response
from worker.core.exits import JobEnd
from worker.nats.result_store import response_of
from worker.nats.subjects import job_results_subject, subject_token

_READ_BATCH = 512
_BAR_CELLS = 30
_RECOUNT_EVERY = 30


@dataclass
class Progress:
    total: int
    ok: int = 0
    error: int = 0
    started_s: float = 0.0
    done_at_start: int = 0  # results already there when the watch began: not in the rate
    unreadable: int = 0  # messages on the job's result subjects that are no result
    foreign: int = 0  # results whose task id is no task of the job (not counted)
    response_unreadable: int = 0  # `ok` results whose stored response cannot be read

    @property
    def done(self) -> int:
        return self.ok + self.error + self.response_unreadable

    @property
    def missing(self) -> int:
        return max(0, self.total - self.done)

    def rate(self, now_s: float) -> float:
        elapsed = now_s - self.started_s
        return (self.done - self.done_at_start) / elapsed if elapsed > 0 else 0.0

    def eta_s(self, now_s: float) -> float | None:
        rate = self.rate(now_s)
        return self.missing / rate if rate > 0 else None

    def summary(self) -> str:
        line = f"ok={self.ok} error={self.error} missing={self.missing}"
        for name in ("response_unreadable", "foreign", "unreadable"):
            if getattr(self, name):
                line += f" {name}={getattr(self, name)}"
        return line

    def exit_code(self) -> int:
        """How the job stands (``exits.JobEnd``): missing wins over error."""
        if self.total == 0:
            return JobEnd.NO_TASKS
        if self.missing:
            return JobEnd.SOME_MISSING
        return JobEnd.SOME_ERROR if self.error or self.response_unreadable else JobEnd.ALL_OK


def render(progress: Progress, now_s: float, tty: bool) -> str:
    """One status line: a bar on a terminal, plain key=value words otherwise."""
    total = max(progress.total, 1)
    eta = progress.eta_s(now_s)
    eta_text = f"{eta:.0f}s" if eta is not None else "?"
    words = (
        f"{progress.done}/{progress.total} {progress.summary()} "
        f"rate={progress.rate(now_s):.1f}/s eta={eta_text}"
    )
    if not tty:
        return words
    filled = min(_BAR_CELLS, round(_BAR_CELLS * progress.done / total))
    return f"[{'#' * filled}{'.' * (_BAR_CELLS - filled)}] {words}"


class ResultCounter:
    """Reads each of a job's results once, as they arrive, and counts those of the job's
    tasks (``known``) by status; a result for an id not known yet is held until it is."""

    def __init__(self, js: JetStreamContext, settings: NatsSettings, job_id: str) -> None:
        self._js = js
        self._settings = settings
        self._job_id = job_id
        self._sub: Any = None
        self._name = ""
        self.seen: set[str] = set()
        self.held: dict[str, dict[str, Any]] = {}  # task id -> its result, the id unknown

    async def open(self) -> None:
        self._sub = await self._js.pull_subscribe(
            job_results_subject(self._job_id),
            stream=self._settings.results_stream,
            config=api.ConsumerConfig(
                ack_policy=api.AckPolicy.NONE,
                deliver_policy=api.DeliverPolicy.ALL,
                inactive_threshold=300.0,  # outlives an outage; deleted by close() anyway
            ),
        )
        self._name = (await self._sub.consumer_info()).name

    async def read(self, progress: Progress, wait_s: float, known: set[str]) -> None:
        """Count what arrived, waiting at most ``wait_s`` for something new."""
        assert self._sub is not None, "open() first"
        try:
            msgs = await self._sub.fetch(_READ_BATCH, timeout=wait_s)
        except (nats.errors.TimeoutError, TimeoutError):
            msgs = []
        for msg in msgs:
            result = read_result(msg.data)
            if result is None:  # not a result (a client may publish there): counted, skipped
                progress.unreadable += 1
                continue
            self.held.setdefault(result["task_id"], result)
        for task_id in [t for t in self.held if t in known]:
            await self._count(progress, self.held.pop(task_id))
        progress.foreign = len(self.held)

    async def _count(self, progress: Progress, result: dict[str, Any]) -> None:
        if result["task_id"] in self.seen:
            return
        self.seen.add(result["task_id"])
        if result.get("status") != "ok":
            progress.error += 1
        elif unreadable_response(await response_of(self._js, result)):
            progress.response_unreadable += 1
        else:
            progress.ok += 1

    async def close(self) -> None:
        if self._sub is None:
            return
        try:
            await self._sub.unsubscribe()
            await self._js.delete_consumer(self._settings.results_stream, self._name)
        except (nats.errors.Error, TimeoutError):
            pass  # the server drops it after its inactive threshold anyway


async def watch_job(
    js: JetStreamContext,
    settings: NatsSettings,
    job_id: str,
    out: TextIO,
    *,
    timeout_s: float,
    interval_s: float = 1.0,
    expected: set[str] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Progress:
    """Follow the job until every task has a result or ``timeout_s`` passes; draw progress on
    ``out`` and end with the summary line. ``expected``: the job's task ids when the caller
    published them; else they are read from the tasks stream. Returns the final counts
    (``total`` 0: the job has no tasks on its own subjects). A NATS error while following is
    waited out to the deadline; only a missing stream at the start raises."""
    tty = out.isatty()
    tasks = JobTasks(js, settings, job_id)
    known = expected if expected is not None else await tasks.refresh()
    progress = Progress(total=len(known), started_s=clock())
    if not known:
        out.write(
            f"job {job_id}: no tasks on tasks.*.{subject_token(job_id)} (submit publishes "
            "there; tasks on tasks.<pipeline> alone cannot be followed)\n"
        )
        return progress
    counter = ResultCounter(js, settings, job_id)
    await counter.open()

    async def recount() -> set[str]:
        return await tasks.refresh()

    try:
        await _follow(
            counter,
            progress,
            known,
            _Drawing(out, tty, interval_s),
            deadline=clock() + timeout_s,
            clock=clock,
            recount=recount if expected is None else None,
        )
    finally:
        await counter.close()
    if tty:
        out.write("\n")
    out.write(f"job {job_id}: {progress.summary()}\n")
    out.flush()
    return progress


class _Drawing:
    """Progress on ``out``: redrawn in place on a terminal, else one line per interval (and
    the last one)."""

    def __init__(self, out: TextIO, tty: bool, interval_s: float) -> None:
        self.out = out
        self.tty = tty
        self.interval_s = interval_s
        self._last_line_s = -interval_s

    def draw(self, progress: Progress, now: float, last: bool) -> None:
        if self.tty:
            self.out.write("\r\x1b[K" + render(progress, now, tty=True))
            self.out.flush()
        elif now - self._last_line_s >= self.interval_s or last:
            self.out.write(render(progress, now, tty=False) + "\n")
            self.out.flush()
            self._last_line_s = now


async def _follow(
    counter: ResultCounter,
    progress: Progress,
    known: set[str],
    drawing: _Drawing,
    *,
    deadline: float,
    clock: Callable[[], float],
    recount: Callable[[], Awaitable[set[str]]] | None,
) -> None:
    """Count results and draw until every task has one or ``deadline`` passes; the job's
    tasks are counted again now and then when ``recount`` is given."""
    interval_s = drawing.interval_s
    refreshes = 0
    while True:
        try:
            wait_s = min(interval_s, max(0.05, deadline - clock()))
            await counter.read(progress, wait_s, known)
            refreshes += 1
            if refreshes == 1:
                progress.done_at_start = progress.done
            if recount is not None and (refreshes % _RECOUNT_EVERY == 0 or counter.held):
                known = await recount()  # new tasks, or a result for an id not seen yet
                progress.total = max(progress.total, len(known))
        except (nats.errors.Error, TimeoutError) as error:
            drawing.out.write(
                f"\nNATS: {type(error).__name__}; still following until the timeout\n"
            )
            await asyncio.sleep(min(interval_s, max(0.0, deadline - clock())))
        progress.total = max(progress.total, progress.done)
        now = clock()
        finished = progress.missing == 0
        drawing.draw(progress, now, last=finished or now >= deadline)
        if finished or now >= deadline:
            return
