"""The delivery rules, in one place: every decision about what becomes of a delivery.

A message that cannot name its job and task is dead-lettered (kept with the reason, then
terminated); one that names them but cannot be run gets an ``error`` result; a redelivered one
whose result is already stored is only acked. A task is acked only after its result is
stored. Permanent failures get an ``error`` result and an ack; transient ones are naked with
a backoff delay, except on the last delivery, which gets an ``error`` result saying the
deliveries ran out; so does a task whose last delivery died with its worker (the
max-deliveries advisory asks ``exhausted``). Retries are counted with the server's
``num_delivered``, never in memory. Admission and the advisory handler only ask.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import nats
import structlog
from nats.js import JetStreamContext

from config.errors import (
    ErrorKind,
    Failure,
    InvalidTask,
    ResultRefused,
    ResultsUnavailable,
    Undeliverable,
)
from config.redact import scrub, shorten
from config.settings import NatsSettings
from worker.outcome import Outcome
from worker.ports import Delivery
from worker.results import ResultStore, unavailable
from worker.schemas import Task, invalid_task, make_result, parse_task, subject_pipeline

log = structlog.get_logger(__name__)
_STORE_RETRY_FIRST_S = 0.2
_STORE_RETRY_MAX_S = 5.0
_HEADER_VALUE_CHARS = 1000
EXHAUSTED_KIND: ErrorKind = "deliveries_exhausted"


def backoff_s(delivered: int, base_s: float, max_s: float) -> float:
    return float(min(max_s, base_s * (2 ** max(0, delivered - 1))))


@dataclass(frozen=True)
class Read:
    """What a message's bytes make: a task, a task that cannot be run (``failure``: it gets an
    error result), or nothing that names a job and a task (``task`` None: a dead letter)."""

    task: Task | None
    failure: Failure | None = None
    dead_letter_reason: str = ""


def read_task(data: bytes, subject: str) -> Read:
    try:
        return Read(parse_task(data, subject))
    except Undeliverable as error:
        return Read(None, dead_letter_reason=str(error))
    except InvalidTask as error:
        return Read(invalid_task(error, subject_pipeline(subject)), error.failure())


@dataclass
class Settler:
    js: JetStreamContext
    store: ResultStore
    settings: NatsSettings
    pipeline: str
    model: dict[str, Any]
    max_deliver: int
    count: Callable[[str], None] = lambda _outcome: None
    # A result not written because one was already stored: a second completion of the task.
    completed_twice: Callable[[], None] = lambda: None
    # Several pipelines: each task's own pipeline's ``model`` (``pipeline``/``model`` above are
    # the default pipeline's, for a task that names none).
    model_of: Callable[[str], dict[str, Any]] | None = None
    worker_id: dict[str, Any] = field(
        default_factory=lambda: {"host": socket.gethostname(), "pid": os.getpid()}
    )

    async def settle(self, task: Task, msg: Delivery, delivered: int, outcome: Outcome) -> str:
        """Store-then-ack, or nak, for the engine's ``outcome``; returns what is counted (ok,
        error, retried, ...)."""
        bound = log.bind(task_id=task.id, job_id=task.job_id, attempt=delivered)
        if outcome.retryable and delivered < self.max_deliver:
            return await self._retry(msg, delivered, bound, outcome.failure)
        if outcome.failure is not None and outcome.retryable:
            last = outcome.failure.message or outcome.failure.kind
            message = f"deliveries ran out after {delivered} attempts; last error: {last}"
            outcome = replace(outcome, failure=replace(outcome.failure, message=message))
        result = self.result(task, delivered, outcome)
        try:
            result = await self._store_or_smaller(result, task, delivered)
        except ResultRefused as refused:
            return await self.dead_letter(msg, f"no result can be stored for this task: {refused}")
        except ResultsUnavailable as failure:
            return await self._unconfirmed(
                msg, delivered, bound, failure, "result", "stores an error result for it"
            )
        await _settle_message(msg.ack, bound)
        status = str(result["status"])
        self.count(status)
        _log_done(bound, result)
        return status

    async def already_stored(self, msg: Delivery, task: Task) -> None:
        """A redelivered task whose result is stored (its ack was lost): ack only."""
        await msg.ack()  # if it fails, the admission boundary logs it and gives it back
        log.info("redelivered_task_already_stored", task_id=task.id, job_id=task.job_id)

    async def give_back(self, msg: Delivery) -> None:
        """Nak now: a message we could not even admit comes back at once."""
        try:
            await msg.nak()
        except Exception as error:  # noqa: BLE001 - the ack wait brings it back anyway
            log.warning("settle_action_failed", error=f"{type(error).__name__}: {error}")

    async def exhausted(self, data: bytes, subject: str, seq: int, deliveries: int) -> bool:
        """The last delivery of a task died with its worker: store its ``error`` result
        (create-if-absent: a result the dying worker stored stands), or dead-letter it when it
        names no task or no result fits. False when the store did not confirm (ask again)."""
        read = read_task(data, subject)
        if read.task is None:
            # Its last delivery failed to dead-letter it (or died first): do it here. The
            # dead-letter stream keeps one copy if the worker's attempt did land.
            if not await self._confirmed(
                self.keep_dead_letter(data, subject, seq, read.dead_letter_reason)
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
        result = self.result(read.task, deliveries, Outcome(failure=failure))
        try:
            stored = await self.store.store(result)
        except ResultsUnavailable:
            return False
        except ResultRefused as refused:
            why = f"no result fits: {refused}"
            if not await self._confirmed(self.keep_dead_letter(data, subject, seq, why)):
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

    @staticmethod
    async def _confirmed(write: Awaitable[None]) -> bool:
        try:
            await write
        except ResultsUnavailable:
            return False
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
            smaller = self.result(
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
        """Store, retrying in-process for ``store_retry_s``: the result is already computed, and
        an outage of the results stream is no reason to spend one of the task's deliveries."""

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

        await self._patiently(store)

    async def _patiently(self, write: Callable[[], Awaitable[None]]) -> None:
        """Run ``write`` until it does not raise ResultsUnavailable, for ``store_retry_s``."""
        deadline = time.monotonic() + self.settings.store_retry_s
        delay_s = _STORE_RETRY_FIRST_S
        while True:
            try:
                await write()
                return
            except ResultsUnavailable as failure:
                if failure.connection_closed:
                    raise
                if time.monotonic() + delay_s > deadline:
                    raise
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, _STORE_RETRY_MAX_S)

    def result(self, task: Task, delivered: int, outcome: Outcome) -> dict[str, Any]:
        error = outcome.failure.as_dict() if outcome.failure is not None else None
        pipeline = task.pipeline or self.pipeline
        model = self.model_of(pipeline) if self.model_of is not None else self.model
        return make_result(
            task=task,
            pipeline=pipeline,
            detections=outcome.detections,
            error=error,
            model=model,
            timings_s=outcome.timings_s,
            worker=self.worker_id,
            attempt=delivered,
        )

    async def _unconfirmed(
        self,
        msg: Delivery,
        delivered: int,
        bound: Any,
        failure: ResultsUnavailable,
        what: str,
        advisory_does: str,
    ) -> str:
        """The store did not confirm ``what``: give the message back. On its last delivery the
        max-deliveries advisory takes over, and that is said in the log."""
        if delivered >= self.max_deliver:
            bound.error(
                f"{what}_not_stored_on_last_delivery",
                error=str(failure),
                hint=f"the max-deliveries advisory {advisory_does}",
            )
        return await self._retry(msg, delivered, bound, failure.failure())

    async def _retry(self, msg: Delivery, delivered: int, bound: Any, why: Failure | None) -> str:
        delay_s = backoff_s(
            delivered, self.settings.nak_backoff_base_s, self.settings.nak_backoff_max_s
        )
        try:
            await msg.nak(delay=delay_s)
        except nats.errors.Error as error:  # the ack wait will bring it back anyway
            bound.warning("nak_failed", error=str(error))
        bound.info("task_retried", delay_s=delay_s, reason=why.message if why else None)
        self.count("retried")
        return "retried"

    async def dead_letter(self, msg: Delivery, reason: str) -> str:
        """Keep a message and the reason on the dead-letter subject, confirmed; then terminate.

        If the dead-letter stream does not confirm, the message is given back (nak); on its
        last delivery the max-deliveries advisory dead-letters it instead. Nothing is lost.
        """
        seq = msg.metadata.sequence.stream
        delivered = msg.metadata.num_delivered
        bound = log.bind(stream_seq=seq, attempt=delivered)
        try:
            await self.keep_dead_letter(msg.data, msg.subject, seq, reason)
        except ResultsUnavailable as failure:
            return await self._unconfirmed(
                msg, delivered, bound, failure, "dead_letter", "dead-letters it"
            )
        await _settle_message(msg.term, bound)
        self.count("dead_lettered")
        bound.warning(
            "task_dead_lettered",
            reason=reason,
            preview=json.dumps(msg.data[:200].decode("utf-8", "replace")),
        )
        return "dead_lettered"

    async def keep_dead_letter(self, data: bytes, subject: str, seq: int, reason: str) -> None:
        """Publish to the dead-letter stream until it confirms, for ``store_retry_s`` at most.

        The tasks stream's sequence is the dedupe id: the worker and the advisory handler may
        both dead-letter one message, and the stream keeps it once.
        """
        headers = {
            "Nats-Msg-Id": f"dead-{self.settings.tasks_stream}-{seq}",
            "Worker-Reason": header_value(reason),
            "Worker-Original-Subject": header_value(subject),
            "Worker-Original-Sequence": str(seq),
        }
        limit = self.store.max_message_bytes()
        if len(data) > limit:
            # The copy plus our headers must fit the server's max_payload, or the server
            # drops our connection: keep the head, and say what the whole was.
            headers["Worker-Truncated-From-Bytes"] = str(len(data))
            headers["Worker-Original-Sha256"] = hashlib.sha256(data).hexdigest()
            data = data[:limit]

        async def publish() -> None:
            try:
                await self.js.publish(
                    self.settings.dead_letter_subject,
                    data,
                    timeout=self.settings.publish_timeout_s,
                    stream=self.settings.dead_letter_stream,
                    headers=headers,
                )
            except (nats.errors.Error, TimeoutError) as error:
                raise unavailable("dead-letter stream unavailable", error) from None

        await self._patiently(publish)


def header_value(text: str) -> str:
    """``text`` as a header value: one printable line, capped (a newline would break the
    protocol and the server would close our connection)."""
    return shorten(scrub(text), _HEADER_VALUE_CHARS)


async def _settle_message(action: Callable[[], Awaitable[None]], bound: Any) -> None:
    """Ack or term; if the connection is gone, the ack wait redelivers the message, and the
    stored result (or the deduplicated dead letter) makes that harmless."""
    try:
        await action()
    except (nats.errors.Error, TimeoutError) as error:
        bound.warning("settle_message_failed", action=action.__name__, error=str(error))


def _log_done(bound: Any, result: dict[str, Any]) -> None:
    """The one line per completed task (README, "Logs"): its ids, status, attempt and stage
    timings; an error's type and scrubbed message. INFO when ok, WARNING when not."""
    fields: dict[str, Any] = {"status": result["status"], **result["timings_s"]}
    error = result["error"]
    if error:
        bound.warning("task_done", **fields, error_type=error["type"], error=error["message"])
        return
    response = result.get("response") or {}
    detections = response.get("detections")
    bound.info("task_done", **fields, detections=len(detections) if detections else 0)
