"""The NATS source's settler: the core's verdict on a task from the tasks stream, carried out.

Keep: the result is stored, then the message acked (a task is acked only after its result is
stored); a result the results stream refuses becomes a small error result, and when not even
that fits, a dead letter. Retry: a nak with the verdict's delay. Unnamed: the message is kept
with the reason on the dead-letter subject, then terminated. Done before: acked only. Given
back: a nak now, or after the verdict's delay. A store or dead letter the stream does not
confirm gives the message back; on its last delivery the max-deliveries advisory takes over
(``exhausted``: the error result of a task whose last delivery died with its worker). Retries
are counted with the server's ``num_delivered``, never in memory.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import nats
import structlog

from config.errors import ErrorKind, Failure, ResultRefused, ResultsUnavailable
from worker.core.outcome import Outcome
from worker.core.results import Kept, Result, ResultMaker, Settled
from worker.core.tasks import read_task
from worker.core.verdicts import Backoff, Decision, Verdict
from worker.nats.dead_letters import DeadLetters
from worker.nats.delivery import NatsDelivered
from worker.nats.patience import UntilConnected, at_once, patiently
from worker.nats.render import document
from worker.nats.result_store import ResultStore
from worker.nats.subjects import subject_job, subject_pipeline

log = structlog.get_logger(__name__)
EXHAUSTED_KIND: ErrorKind = "deliveries_exhausted"


@dataclass
class NatsSettler:
    """The NATS source's side of each verdict (the core's ``Settler``)."""

    store: ResultStore
    dead_letters: DeadLetters
    documents: ResultMaker  # the max-deliveries advisory's results (``exhausted``)
    default_pipeline: str
    store_retry_s: float
    backoff: Backoff
    # The advisory's results, counted as the orchestrator counts the rest.
    count: Callable[[str, str], None] = lambda _outcome, _pipeline: None
    # A result not written because one was already stored: a second completion of the task.
    completed_twice: Callable[[], None] = lambda: None
    # A store retried while the client reconnects waits for the new connection (within
    # ``store_retry_s``) and is made on it at once: see ``patience``.
    until_connected: UntilConnected = at_once

    async def settle(self, delivered: NatsDelivered, verdict: Verdict) -> Settled:
        """Store-then-ack, nak, or dead-letter, as ``verdict`` says; what was done."""
        bound = log.bind(attempt=delivered.delivered, **_named(delivered))
        decision = verdict.decision
        if decision is Decision.KEEP:
            if verdict.result is None:
                raise ValueError("a keep verdict carries its result")
            return await self._keep(delivered, bound, verdict.result)
        if decision is Decision.RETRY:
            return await self._retry(delivered, bound, verdict.delay_s, verdict.reason)
        if decision is Decision.UNNAMED:
            return await self._dead_letter(delivered, verdict.reason)
        if decision is Decision.DONE_BEFORE:
            # If the ack fails, the admission boundary logs it and gives the task back.
            await delivered.handle.msg.ack()
            bound.info("redelivered_task_already_stored")
            return Settled(Kept.DONE_BEFORE)
        await self._give_back(delivered, verdict.delay_s)
        return Settled(Kept.GIVEN_BACK)

    async def keep_alive(self, delivered: NatsDelivered) -> None:
        """Extend the message's ack wait."""
        await delivered.handle.msg.in_progress()

    async def _keep(self, delivered: NatsDelivered, bound: Any, result: Result) -> Settled:
        try:
            stored = await self._store_or_smaller(result)
        except ResultRefused as refused:
            why = f"no result can be stored for this task: {refused}"
            return await self._dead_letter(delivered, why)
        except ResultsUnavailable as failure:
            return await self._unconfirmed(
                delivered, bound, failure, "result", "stores an error result for it"
            )
        await _settle_message(delivered.handle.msg.ack, bound)
        return _said(stored)

    async def _give_back(self, delivered: NatsDelivered, delay_s: float = 0.0) -> None:
        """Nak: the task comes back at once, or after ``delay_s`` (its pipeline unavailable
        here: the retry backoff's delay, so it is not bounced straight back)."""
        try:
            await delivered.handle.msg.nak(delay=delay_s if delay_s > 0 else None)
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
                self.dead_letters.keep(data, subject, seq, read.unnamed_reason)
            ):
                return False
            log.warning("exhausted_task_dead_lettered", stream_seq=seq, reason=read.unnamed_reason)
            return True
        message = (
            f"deliveries ran out: all {deliveries} deliveries ended without a result "
            "(the worker holding it died, was killed or stopped answering)"
        )
        failure = Failure(EXHAUSTED_KIND, message, retryable=True)
        result = self.documents.make(read.task, deliveries, Outcome(failure=failure))
        try:
            stored = await self.store.store(document(result))
        except ResultsUnavailable:
            return False
        except ResultRefused as refused:
            why = f"no result fits: {refused}"
            if not await _confirmed(self.dead_letters.keep(data, subject, seq, why)):
                return False
            stored = False
        if stored:
            self.count("error", read.task.pipeline)
        log.warning(
            "task_deliveries_exhausted",
            task_id=read.task.id,
            job_id=read.task.job_id,
            deliveries=deliveries,
            result_stored=stored,
        )
        return True

    async def _store_or_smaller(self, result: Result) -> dict[str, Any]:
        """Store ``result``; if no retry could store it, store a small error result instead.

        Returns what was stored. ResultRefused when not even that fits; ResultsUnavailable
        when the stream did not confirm.
        """
        stored = document(result)
        try:
            await self._store_patiently(stored)
            return stored
        except ResultRefused as refused:
            failure = Failure(refused.kind, f"the result could not be stored: {refused}")
            # Its own failure, said as it is: not the task's, which may have run out.
            smaller = document(replace(result, detections=None, failure=failure, ran_out=False))
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
        delivered: NatsDelivered,
        bound: Any,
        failure: ResultsUnavailable,
        what: str,
        advisory_does: str,
    ) -> Settled:
        """The store did not confirm ``what``: give the message back. On its last delivery the
        max-deliveries advisory takes over, and that is said in the log."""
        if delivered.deliveries_left <= 0:
            bound.error(
                f"{what}_not_stored_on_last_delivery",
                error=str(failure),
                hint=f"the max-deliveries advisory {advisory_does}",
            )
        delay_s = self.backoff.delay_s(delivered.delivered)
        return await self._retry(delivered, bound, delay_s, failure.failure().message)

    async def _retry(
        self, delivered: NatsDelivered, bound: Any, delay_s: float, why: str
    ) -> Settled:
        try:
            await delivered.handle.msg.nak(delay=delay_s)
        except nats.errors.Error as error:  # the ack wait will bring it back anyway
            bound.warning("nak_failed", error=str(error))
        bound.info("task_retried", delay_s=delay_s, reason=why or None)
        return Settled(Kept.RETRIED)

    async def _dead_letter(self, delivered: NatsDelivered, reason: str) -> Settled:
        """Keep a message and the reason on the dead-letter subject, confirmed; then terminate.

        If the dead-letter stream does not confirm, the message is given back (nak); on its
        last delivery the max-deliveries advisory dead-letters it instead. Nothing is lost.
        """
        msg, seq = delivered.handle.msg, delivered.handle.stream_seq
        bound = log.bind(stream_seq=seq, attempt=delivered.delivered)
        try:
            await self.dead_letters.keep(msg.data, msg.subject, seq, reason)
        except ResultsUnavailable as failure:
            return await self._unconfirmed(
                delivered, bound, failure, "dead_letter", "dead-letters it"
            )
        await _settle_message(msg.term, bound)
        bound.warning(
            "task_dead_lettered",
            reason=reason,
            preview=json.dumps(msg.data[:200].decode("utf-8", "replace")),
        )
        return Settled(Kept.DEAD_LETTERED)


def _named(delivered: NatsDelivered) -> dict[str, Any]:
    """How the log names a delivered task: its ids when it names them."""
    task = delivered.read.task
    if task is None:
        return {"stream_seq": delivered.handle.stream_seq}
    return {"task_id": task.id, "job_id": task.job_id}


def _said(stored: dict[str, Any]) -> Settled:
    """What the ``task_done`` line says of a stored result document."""
    error = stored["error"]
    if error:
        return Settled(Kept.ERROR, error_type=error["type"], error=error["message"])
    detections = (stored.get("response") or {}).get("detections")
    return Settled(Kept.OK, detections=len(detections or []))


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
