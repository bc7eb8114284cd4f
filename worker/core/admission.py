"""Admission: a delivery's way in. What becomes of it is the delivery rules' decision
(``worker.core.verdicts.read_task`` says what its bytes make; the source's ``DeliveryRules`` act): a
delivery that cannot name its job and task is dead-lettered; one that names them but cannot
be run gets an ``error`` result; one whose result is already stored is only acked; the rest
are entered in the claims (held tasks), to be loaded.
"""

from __future__ import annotations

import structlog

from config.errors import ResultsUnavailable
from worker.core.claims import Claim, Claims
from worker.core.outcome import Outcome
from worker.core.ports import Delivery, DeliveryRules, Results
from worker.core.tasks import Task
from worker.core.verdicts import read_task

log = structlog.get_logger(__name__)


class Admission:
    def __init__(
        self, rules: DeliveryRules, results: Results, claims: Claims, default_pipeline: str
    ) -> None:
        self._rules = rules
        self._results = results
        self._claims = claims
        self._default_pipeline = default_pipeline

    async def admit(self, delivery: Delivery) -> Claim | None:
        """The per-delivery boundary: whatever a delivery holds, a failure to admit it is
        logged and the delivery given back, never the end of the fetch loop."""
        try:
            return await self._admit(delivery)
        except Exception:
            log.exception("admission_failed", **delivery.log_fields())
            await self._rules.give_back(delivery)
            return None

    async def _admit(self, delivery: Delivery) -> Claim | None:
        read = read_task(delivery.data, delivery.pipeline, delivery.job_id, self._default_pipeline)
        if read.task is None:
            await self._rules.dead_letter(delivery, read.dead_letter_reason)
            return None
        if read.failure is not None:
            await self._rules.settle(read.task, delivery, Outcome(failure=read.failure))
            return None
        # Any delivery, not only a redelivery: a job's consumer made again
        # (worker.nats.job_consumers) walks its job from the start, and a task done already
        # must not run twice.
        if await self._already_stored(delivery, read.task):
            return None
        return self._claims.add(delivery, read.task)

    async def _already_stored(self, delivery: Delivery, task: Task) -> bool:
        """A task whose result is saved (its ack was lost, or its job's consumer was made
        again) is only acked."""
        try:
            stored = await self._results.exists(task.job_id, task.id)
        except ResultsUnavailable:
            return False  # the store refuses duplicates anyway
        if stored:
            await self._rules.already_stored(delivery, task)
        return stored
