"""Admission: a delivered task's way in. Its source read it once (``tasks.read_task``); here
the core decides what becomes of it (``verdicts.Verdict``), and the source's settler acts: one
that names no job and task is kept aside (dead-lettered); one that names them but cannot be
run gets an ``error`` result; one whose result is already kept is settled without another;
one of a pipeline unavailable on this host (``availability``) is given back after the retry
backoff's delay, unless on its last delivery and its source extends leases; the rest are
entered in the claims (held tasks), to be loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog

from config.errors import ResultsUnavailable
from worker.core.availability import may_give_back
from worker.core.claims import Claim, Claims
from worker.core.outcome import Outcome
from worker.core.ports import Delivered, Results, Settler
from worker.core.results import ResultMaker
from worker.core.tasks import Task
from worker.core.verdicts import NO_BACKOFF, Backoff, Decision, Verdict

log = structlog.get_logger(__name__)


class Admission:
    def __init__(
        self,
        settler: Settler[Any],
        results: Results,
        claims: Claims,
        maker: ResultMaker,
        available: Callable[[str], bool] = lambda _pipeline: True,
        backoff: Backoff = NO_BACKOFF,
        holds_last: bool = True,
        retry_in_s: Callable[[str], float] = lambda _pipeline: 0.0,
    ) -> None:
        self._settler = settler
        self._results = results
        self._claims = claims
        self._maker = maker
        self._available = available  # whether a pipeline's models can be had on this host
        self._backoff = backoff  # how long a task given back for that waits
        self._holds_last = holds_last  # its last delivery held (the source extends leases)
        self._retry_in_s = retry_in_s  # until an unavailable pipeline's next load

    async def admit(self, delivered: Delivered[Any]) -> Claim | None:
        """The per-delivery boundary: whatever a delivery holds, a failure to admit it is
        logged and the delivery given back, never the end of the fetch loop."""
        try:
            return await self._admit(delivered)
        except Exception:
            log.exception("admission_failed", **delivered.log_fields)
            why = "it could not be admitted"
            await self._settler.settle(delivered, Verdict(Decision.GIVE_BACK, reason=why))
            return None

    async def _admit(self, delivered: Delivered[Any]) -> Claim | None:
        read = delivered.read
        if read.task is None:
            verdict = Verdict(Decision.UNNAMED, reason=read.unnamed_reason)
            await self._settler.settle(delivered, verdict)
            return None
        if read.failure is not None:
            outcome = Outcome(failure=read.failure)
            result = self._maker.make(read.task, delivered.delivered, outcome)
            await self._settler.settle(delivered, Verdict.keep(result))
            return None
        # Any delivery, not only a redelivery: a job's consumer made again
        # (worker.nats.job_consumers) walks its job from the start, and a task done already
        # must not run twice.
        if await self._done_before(delivered, read.task):
            return None
        if not self._available(read.task.pipeline) and self._gives_back(delivered):
            why = f"pipeline {read.task.pipeline!r} is unavailable on this host"
            if delivered.deliveries_left <= 0 and self._holds_last:
                why += (
                    f"; {self._claims.parked_max} tasks of unavailable pipelines are held "
                    "already: its last delivery, the max-deliveries handler settles it"
                )
            delay_s = max(
                self._backoff.delay_s(delivered.delivered),
                self._retry_in_s(read.task.pipeline),
            )
            await self._settler.settle(
                delivered, Verdict(Decision.GIVE_BACK, delay_s=delay_s, reason=why)
            )
            log.info(
                "task_given_back",
                task_id=read.task.id,
                **delivered.log_fields,
                reason=why,
                delay_s=delay_s,
            )
            return None
        return self._claims.add(delivered, read.task)

    def _gives_back(self, delivered: Delivered[Any]) -> bool:
        """A task of an unavailable pipeline is given back (``may_give_back``), or, on its
        last delivery, when the held tasks of unavailable pipelines are at their cap."""
        left = delivered.deliveries_left
        return may_give_back(left, self._holds_last) or self._claims.parked_full()

    async def _done_before(self, delivered: Delivered[Any], task: Task) -> bool:
        """A task whose result is kept (its ack was lost, or its job's consumer was made
        again) is settled without running it again."""
        try:
            stored = await self._results.exists(task.job_id, task.id)
        except ResultsUnavailable:
            return False  # the store refuses duplicates anyway
        if stored:
            await self._settler.settle(delivered, Verdict(Decision.DONE_BEFORE))
        return stored
