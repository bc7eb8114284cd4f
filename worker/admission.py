"""Admission: a fetched message's way in. What becomes of it is the delivery rules' decision
(``settle.py``: ``read_task`` says what its bytes make; the ``DeliveryRules`` act): a message
that cannot name its job and task is dead-lettered; one that names them but cannot be run
gets an ``error`` result; one whose result is already stored is only acked;
the rest are entered in the claims (held tasks), to be loaded.
"""

from __future__ import annotations

import structlog

from config.errors import ResultsUnavailable
from worker.claims import Claim, Claims
from worker.outcome import Outcome
from worker.ports import Delivery, DeliveryRules, Results
from worker.schemas import Task
from worker.settle import read_task

log = structlog.get_logger(__name__)


class Admission:
    def __init__(self, settler: DeliveryRules, store: Results, claims: Claims) -> None:
        self._settler = settler
        self._store = store
        self._claims = claims

    async def admit(self, msg: Delivery) -> Claim | None:
        """The per-message boundary: whatever a message holds, a failure to admit it is
        logged and the message given back, never the end of the fetch loop."""
        try:
            return await self._admit(msg)
        except Exception:
            log.exception("admission_failed", subject=msg.subject)
            await self._settler.give_back(msg)
            return None

    async def _admit(self, msg: Delivery) -> Claim | None:
        delivered = msg.metadata.num_delivered
        read = read_task(msg.data, msg.subject)
        if read.task is None:
            await self._settler.dead_letter(msg, read.dead_letter_reason)
            return None
        if read.failure is not None:
            await self._settler.settle(read.task, msg, delivered, Outcome(failure=read.failure))
            return None
        # Any delivery, not only a redelivery: a job's consumer made again (worker.nats.jobs)
        # walks its job from the start, and a task done already must not run twice.
        if await self._already_stored(msg, read.task):
            return None
        return self._claims.add(msg, read.task, delivered)

    async def _already_stored(self, msg: Delivery, task: Task) -> bool:
        """A task whose result is stored (its ack was lost, or its job's consumer was made
        again) is only acked."""
        try:
            stored = await self._store.exists(task.job_id, task.id)
        except ResultsUnavailable:
            return False  # the store refuses duplicates anyway
        if stored:
            await self._settler.already_stored(msg, task)
        return stored
