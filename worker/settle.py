"""The delivery rules for one task, in one place.

A task is acked only after its result is stored. Permanent failures get an ``error`` result
and an ack; transient ones are naked with a backoff delay, except on the last delivery,
which gets an ``error`` result saying the deliveries ran out. Retries are counted with the
server's ``num_delivered``, never in memory.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import nats
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from config.settings import NatsSettings
from worker.results import ResultStore, ResultsUnavailable
from worker.schemas import Task, Verdict, error_info, make_result

log = structlog.get_logger(__name__)
_STORE_RETRY_FIRST_S = 0.2
_STORE_RETRY_MAX_S = 5.0


def backoff_s(delivered: int, base_s: float, max_s: float) -> float:
    return float(min(max_s, base_s * (2 ** max(0, delivered - 1))))


@dataclass
class Held:
    """A task fetched and not yet acked, naked or terminated."""

    msg: Msg
    task: Task
    key: int
    delivered: int
    fetched_at: float


@dataclass
class Settler:
    js: JetStreamContext
    store: ResultStore
    settings: NatsSettings
    pipeline: str
    model: dict[str, str]
    max_deliver: int
    count: Callable[[str], None] = lambda _outcome: None
    worker_id: dict[str, Any] = field(
        default_factory=lambda: {"host": socket.gethostname(), "pid": os.getpid()}
    )

    async def settle(self, task: Task, msg: Msg, delivered: int, verdict: Verdict) -> str:
        """Store-then-ack, or nak; returns the outcome counted (ok, error, retried)."""
        bound = log.bind(task_id=task.id, job_id=task.job_id, attempt=delivered)
        if verdict.retryable and delivered < self.max_deliver:
            return await self._retry(msg, delivered, bound, verdict)
        if verdict.retryable:
            last = verdict.error_message or verdict.error_kind
            message = f"deliveries ran out after {delivered} attempts; last error: {last}"
            verdict = replace(verdict, error_message=message)
        result = self.result(task, delivered, verdict)
        error = result["error"]
        try:
            await self._store_patiently(result)
        except ResultsUnavailable as failure:
            if delivered >= self.max_deliver:
                bound.error("result_not_stored_on_last_delivery", error=str(failure))
            return await self._retry(msg, delivered, bound, Verdict(error_message=str(failure)))
        await msg.ack()
        outcome = result["status"]
        self.count(outcome)
        if error:
            bound.warning("task_failed", error_type=error["type"], error=error["message"])
        else:
            bound.debug("task_done")
        return str(outcome)

    async def _store_patiently(self, result: dict[str, Any]) -> None:
        """Store, retrying in-process for ``store_retry_s``: the result is already computed, and
        an outage of the results stream is no reason to spend one of the task's deliveries."""
        deadline = time.monotonic() + self.settings.store_retry_s
        delay_s = _STORE_RETRY_FIRST_S
        while True:
            try:
                await self.store.store(result)
                return
            except ResultsUnavailable:
                if time.monotonic() + delay_s > deadline:
                    raise
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, _STORE_RETRY_MAX_S)

    def result(self, task: Task, delivered: int, verdict: Verdict) -> dict[str, Any]:
        error = None
        if verdict.error_kind is not None:
            message = verdict.error_message or verdict.error_kind
            error = error_info(verdict.error_kind, message, verdict.retryable)
        return make_result(
            task_id=task.id,
            job_id=task.job_id,
            image_id=task.image_id,
            pipeline=self.pipeline,
            status="error" if error else "ok",
            predictions=verdict.predictions,
            error=error,
            model=self.model,
            timings_s=verdict.timings_s,
            worker=self.worker_id,
            attempt=delivered,
        )

    async def _retry(self, msg: Msg, delivered: int, bound: Any, verdict: Verdict) -> str:
        delay_s = backoff_s(
            delivered, self.settings.nak_backoff_base_s, self.settings.nak_backoff_max_s
        )
        try:
            await msg.nak(delay=delay_s)
        except nats.errors.Error as error:  # the ack wait will bring it back anyway
            bound.warning("nak_failed", error=str(error))
        bound.info("task_retried", delay_s=delay_s, reason=verdict.error_message)
        self.count("retried")
        return "retried"

    async def dead_letter(self, msg: Msg, reason: str) -> None:
        """Keep an unparseable message and the reason on the dead-letter subject; terminate it."""
        headers = {
            "Worker-Reason": reason[:1000],
            "Worker-Original-Subject": msg.subject,
            "Worker-Original-Sequence": str(msg.metadata.sequence.stream),
        }
        try:
            await self.js.publish(
                self.settings.dead_letter_subject,
                msg.data,
                timeout=self.settings.publish_timeout_s,
                stream=self.settings.dead_letter_stream,
                headers=headers,
            )
        except (nats.errors.Error, TimeoutError) as error:
            delivered = msg.metadata.num_delivered
            await self._retry(
                msg, delivered, log.bind(subject=msg.subject), Verdict(error_message=str(error))
            )
            return
        await msg.term()
        self.count("dead_lettered")
        log.warning(
            "task_dead_lettered",
            reason=reason,
            subject=msg.subject,
            preview=json.dumps(msg.data[:200].decode("utf-8", "replace")),
        )
