"""The NATS source's delivery rules: what becomes of a delivery from the tasks stream.

A message that cannot name its job and task is dead-lettered (kept with the reason, then
terminated); one that names them but cannot be run gets an ``error`` result; a redelivered one
whose result is already stored is only acked. A task is acked only after its result is
stored. Permanent failures get an ``error`` result and an ack; transient ones are naked with
a backoff delay while deliveries are left (``worker.core.verdicts.retries``), and the last delivery
gets an ``error`` result saying the deliveries ran out; so does a task whose last delivery
died with its worker (the max-deliveries advisory asks ``exhausted``). Retries are counted
with the server's ``num_delivered``, never in memory. Admission and the advisory handler
only ask.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import nats
import structlog
from nats.js import JetStreamContext

from config.errors import ErrorKind, Failure, ResultRefused, ResultsUnavailable
from config.settings import NatsSettings
from worker.core.outcome import Outcome
from worker.core.ports import Delivery
from worker.core.tasks import Task
from worker.core.verdicts import ResultMaker, final, log_task_done, read_task, retries
from worker.nats.dead_letters import DeadLetters
from worker.nats.delivery import own
from worker.nats.patience import UntilConnected, at_once, patiently
from worker.nats.result_store import ResultStore
from worker.nats.subjects import subject_job, subject_pipeline

log = structlog.get_logger(__name__)
EXHAUSTED_KIND: ErrorKind = "deliveries_exhausted"


def backoff_s(delivered: int, base_s: float, max_s: float) -> float:
    return float(min(max_s, base_s * (2 ** max(0, delivered - 1))))


@dataclass
class NatsRules:
    store: ResultStore
    dead_letters: DeadLetters
    documents: ResultMaker
    default_pipeline: str
    store_retry_s: float
    nak_backoff_base_s: float
    nak_backoff_max_s: float
    count: Callable[[str], None] = lambda _outcome: None
    # A result not written because one was already stored: a second completion of the task.
    completed_twice: Callable[[], None] = lambda: None
    # A store retried while the client reconnects waits for the new connection (within
    # ``store_retry_s``) and is made on it at once: see ``patience``.
    until_connected: UntilConnected = at_once

    async def settle(self, task: Task, delivery: Delivery, outcome: Outcome) -> str:
        """Store-then-ack, or nak, for the engine's ``outcome``; returns what is counted (ok,
        error, retried, ...)."""
        delivered = delivery.delivered
        bound = log.bind(task_id=task.id, job_id=task.job_id, attempt=delivered)
        if retries(outcome, delivery):
            return await self._retry(delivery, bound, outcome.failure)
        result = self.documents.make(task, delivered, final(outcome, delivered))
        try:
            result = await self._store_or_smaller(result, task, delivered)
        except ResultRefused as refused:
            why = f"no result can be stored for this task: {refused}"
            return await self.dead_letter(delivery, why)
        except ResultsUnavailable as failure:
            return await self._unconfirmed(
                delivery, bound, failure, "result", "stores an error result for it"
            )
        await _settle_message(delivery.ack, bound)
        status = str(result["status"])
        self.count(status)
        _log_done(bound, result)
        return status

    async def already_stored(self, delivery: Delivery, task: Task) -> None:
        """A redelivered task whose result is stored (its ack was lost): ack only."""
        await delivery.ack()  # if it fails, the admission boundary logs it and gives it back
        log.info("redelivered_task_already_stored", task_id=task.id, job_id=task.job_id)

    async def give_back(self, delivery: Delivery) -> None:
        """Nak now: a message we could not even admit comes back at once."""
        try:
            await delivery.nak()
        except Exception as error:  # noqa: BLE001 - the ack wait brings it back anyway
            log.warning("settle_action_failed", error=f"{type(error).__name__}: {error}")

    async def exhausted(self, data: bytes, subject: str, seq: int, deliveries: int) -> bool:
        """The last delivery of a task died with its worker: store its ``error`` result
        (create-if-absent: a result the dying worker stored stands), or dead-letter it when it
        names no task or no result fits. False when the store did not confirm (ask again)."""
        read = read_task(
            data, subject_pipeline(subject), subject_job(subject), self.default_pipeline
        )
        if read.task is None:
            # Its last delivery failed to dead-letter it (or died first): do it here. The
            # dead-letter stream keeps one copy if the worker's attempt did land.
            if not await _confirmed(
                self.dead_letters.keep(data, subject, seq, read.dead_letter_reason)
            ):
                return False
            log.warning(
                "exhausted_task_dead_lettered", stream_seq=seq, reason=read.dead_letter_reason
            )
            return True
        message = (
            f"deliveries ran out: all {deliveries} deliveries ended without a result "
            "(the worker holding it died, was killed or stopped answering)"
        )
        failure = Failure(EXHAUSTED_KIND, message, retryable=True)
        result = self.documents.make(read.task, deliveries, Outcome(failure=failure))
        try:
            stored = await self.store.store(result)
        except ResultsUnavailable:
            return False
        except ResultRefused as refused:
            why = f"no result fits: {refused}"
            if not await _confirmed(self.dead_letters.keep(data, subject, seq, why)):
                return False
            stored = False
        if stored:
            self.count("error")
        log.warning(
            "task_deliveries_exhausted",
            task_id=read.task.id,
            job_id=read.task.job_id,
            deliveries=deliveries,
            result_stored=stored,
        )
        return True

    async def _store_or_smaller(
        self, result: dict[str, Any], task: Task, delivered: int
    ) -> dict[str, Any]:
        """Store ``result``; if no retry could store it, store a small error result instead.

        Returns what was stored. ResultRefused when not even that fits; ResultsUnavailable
        when the stream did not confirm.
        """
        try:
            await self._store_patiently(result)
            return result
        except ResultRefused as refused:
            smaller = self.documents.make(
                task,
                delivered,
                Outcome(
                    failure=Failure(refused.kind, f"the result could not be stored: {refused}"),
                    timings_s=result.get("timings_s") or {},
                ),
            )
            await self._store_patiently(smaller)
            return smaller

    async def _store_patiently(self, result: dict[str, Any]) -> None:
        """Store, retrying in-process for ``store_retry_s`` (``patience.patiently``)."""
        tries = 0

        async def store() -> None:
            nonlocal tries
            tries += 1
            # On a retry, "already stored" may be our own write whose PubAck was lost.
            if not await self.store.store(result) and tries == 1:
                log.warning(
                    "result_already_stored", task_id=result["task_id"], job_id=result["job_id"]
                )
                self.completed_twice()

        await patiently(store, self.store_retry_s, self.until_connected)

    async def _unconfirmed(
        self,
        delivery: Delivery,
        bound: Any,
        failure: ResultsUnavailable,
        what: str,
        advisory_does: str,
    ) -> str:
        """The store did not confirm ``what``: give the message back. On its last delivery the
        max-deliveries advisory takes over, and that is said in the log."""
        if delivery.deliveries_left <= 0:
            bound.error(
                f"{what}_not_stored_on_last_delivery",
                error=str(failure),
                hint=f"the max-deliveries advisory {advisory_does}",
            )
        return await self._retry(delivery, bound, failure.failure())

    async def _retry(self, delivery: Delivery, bound: Any, why: Failure | None) -> str:
        delay_s = backoff_s(delivery.delivered, self.nak_backoff_base_s, self.nak_backoff_max_s)
        try:
            await delivery.nak(delay_s=delay_s)
        except nats.errors.Error as error:  # the ack wait will bring it back anyway
            bound.warning("nak_failed", error=str(error))
        bound.info("task_retried", delay_s=delay_s, reason=why.message if why else None)
        self.count("retried")
        return "retried"

    async def dead_letter(self, delivery: Delivery, reason: str) -> str:
        """Keep a message and the reason on the dead-letter subject, confirmed; then terminate.

        If the dead-letter stream does not confirm, the message is given back (nak); on its
        last delivery the max-deliveries advisory dead-letters it instead. Nothing is lost.
        """
        msg = own(delivery)
        bound = log.bind(stream_seq=msg.stream_seq, attempt=msg.delivered)
        try:
            await self.dead_letters.keep(msg.data, msg.subject, msg.stream_seq, reason)
        except ResultsUnavailable as failure:
            return await self._unconfirmed(msg, bound, failure, "dead_letter", "dead-letters it")
        await _settle_message(msg.term, bound)
        self.count("dead_lettered")
        bound.warning(
            "task_dead_lettered",
            reason=reason,
            preview=json.dumps(msg.data[:200].decode("utf-8", "replace")),
        )
        return "dead_lettered"


async def _confirmed(write: Awaitable[None]) -> bool:
    try:
        await write
    except ResultsUnavailable:
        return False
    return True


async def _settle_message(action: Callable[[], Awaitable[None]], bound: Any) -> None:
    """Ack or term; if the connection is gone, the ack wait redelivers the message, and the
    stored result (or the deduplicated dead letter) makes that harmless."""
    try:
        await action()
    except (nats.errors.Error, TimeoutError) as error:
        bound.warning("settle_message_failed", action=action.__name__, error=str(error))


def _log_done(bound: Any, result: dict[str, Any]) -> None:
    """``task_done`` (``worker.core.verdicts.log_task_done``) for a stored result."""
    error = result["error"]
    if error:
        log_task_done(
            bound,
            result["status"],
            result["timings_s"],
            error_type=error["type"],
            error=error["message"],
        )
        return
    detections = (result.get("response") or {}).get("detections")
    log_task_done(bound, result["status"], result["timings_s"], detections=len(detections or []))


def nats_rules(
    js: JetStreamContext,
    settings: NatsSettings,
    store: ResultStore,
    default_pipeline: str,
    model_of: Callable[[str], dict[str, Any]] = lambda _pipeline: {},
) -> NatsRules:
    """The rules over the results stream ``store`` and the dead-letter stream, as settled."""
    return NatsRules(
        store,
        DeadLetters(js, settings, store.max_message_bytes),
        ResultMaker(model_of),
        default_pipeline,
        settings.store_retry_s,
        settings.nak_backoff_base_s,
        settings.nak_backoff_max_s,
    )
