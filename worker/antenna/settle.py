"""The delivery rules for a task reserved from Antenna (the orchestrator's ``DeliveryRules``).

Antenna's result post is the result store and the ack in one; it has no nak. So:

- a transient failure on a delivery before the last (Antenna delivers a task ``max_deliver``
  times, 2 by default; the count is the server's, read from the task's reply subject) is left
  to Antenna's redelivery: nothing is posted, and the log says so;
- on the last delivery, and for every permanent failure, an error result with ``image_id``
  is posted (Antenna marks the image failed; without ``image_id`` it would stay pending);
- a result is checked against what this worker registers for the task's pipeline (its job's,
  from the ``Catalog``) before it is posted; one Antenna would accept and then drop becomes
  an error result naming why;
- a result that cannot be posted (``PostFailed``) leaves its task to redelivery.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from config.errors import Failure
from worker.antenna.answers import usable_reply_subject
from worker.antenna.catalog import Catalog
from worker.antenna.post import Poster, PostFailed
from worker.antenna.reservations import AntennaDelivery
from worker.antenna.results import error_result, fit, item, ok_result, problems
from worker.outcome import Outcome
from worker.ports import Delivery
from worker.schemas import Task, make_result

log = structlog.get_logger(__name__)


@dataclass
class AntennaRules:
    poster: Poster
    catalog: Catalog
    max_deliver: int
    max_post_bytes: int
    count: Callable[[str], None] = lambda _outcome: None
    worker_id: dict[str, Any] = field(
        default_factory=lambda: {"host": socket.gethostname(), "pid": os.getpid()}
    )

    async def settle(self, task: Task, msg: Delivery, delivered: int, verdict: Outcome) -> str:
        bound = log.bind(
            task_id=task.id, job_id=task.job_id, image_id=task.image_id, attempt=delivered
        )
        if verdict.retryable and delivered < self.max_deliver:
            await msg.nak()
            bound.info(
                "task_retried",
                reason=verdict.failure.message if verdict.failure else None,
                how="left to Antenna's redelivery",
            )
            self.count("retried")
            return "retried"
        slug = self._slug(task, msg)
        result, status, why = self._result(task, delivered, verdict, slug)
        entry, steps = fit(task, item(task, result), self.max_post_bytes)
        if steps:
            bound.warning("result_made_smaller", steps=steps)
            if "error_result" in steps:
                status, why = "error", entry["result"]["error"]
        try:
            posted = await self.poster.post(_job_id(msg, task), task, entry, _deadline(msg))
        except PostFailed as failed:
            await msg.nak()
            bound.warning(
                "result_not_posted", reason=str(failed), how="left to Antenna's redelivery"
            )
            self.count("retried")
            return "retried"
        await msg.ack()
        if posted is not entry:  # replaced by an error result after Antenna refused it
            status, why = "error", str(posted["result"].get("error"))
        self.count(status)
        if status == "ok":
            detections = len(posted["result"].get("detections") or [])
            bound.info("task_done", status=status, detections=detections, **verdict.timings_s)
        else:
            bound.warning("task_done", status=status, error=why, **verdict.timings_s)
        return status

    def _result(
        self, task: Task, delivered: int, verdict: Outcome, slug: str
    ) -> tuple[dict[str, Any], str, str]:
        """The result to post, its status, and why when it is an error."""
        if verdict.failure is not None:
            failure = verdict.failure
            message = f"{failure.kind}: {failure.message}"
            if failure.retryable:
                message = f"deliveries ran out after {delivered} attempts; last error: {message}"
            return error_result(task, message), "error", message
        shaped = make_result(
            task=task,
            pipeline=slug,
            detections=verdict.detections,
            error=None,
            model={},
            timings_s=verdict.timings_s,
            worker=self.worker_id,
            attempt=delivered,
        )
        served = self.catalog.get(slug)
        if served is None:  # not made by loaded models: cannot be (see Catalog)
            message = f"pipeline {slug!r} has no loaded models to name in the result"
            return error_result(task, message), "error", message
        result = ok_result(task, shaped["response"], served, slug)
        found = problems(result, task, served, slug)
        if found:
            message = "Antenna would not save this result: " + "; ".join(found)
            return error_result(task, message), "error", message
        return result, "ok", ""

    def _slug(self, task: Task, msg: Delivery) -> str:
        pipeline = getattr(task, "pipeline", "") or ""
        if not pipeline:
            import json

            try:
                pipeline = str(json.loads(msg.data).get("pipeline") or "")
            except (ValueError, AttributeError):
                pipeline = ""
        return pipeline or self.catalog.default

    async def already_stored(self, msg: Delivery, task: Task) -> None:
        """Never asked: Antenna cannot say whether a task's result is saved."""
        await msg.ack()

    async def give_back(self, msg: Delivery) -> None:
        """Antenna has no nak: the reservation runs out and the task is delivered again."""
        await msg.nak()

    async def dead_letter(self, msg: Delivery, reason: str) -> str:
        """A task too broken to name itself (no usable ``id``). With a usable reply subject it
        still gets its error result (with its image, when it names one); without one nothing
        can be posted: logged, and Antenna delivers it again once and then drops it."""
        if isinstance(msg, AntennaDelivery) and usable_reply_subject(msg.reply_subject):
            task = Task("", str(msg.job_id), msg.image_id, "", reply_subject=msg.reply_subject)
            invalid = Outcome(failure=Failure("invalid_task", reason))
            return await self.settle(task, msg, self.max_deliver, invalid)
        log.error(
            "antenna_task_unusable",
            reason=reason,
            subject=msg.subject,
            action="left to Antenna's redelivery; no reply subject to post a result to",
        )
        await msg.term()
        self.count("dead_lettered")
        return "dead_lettered"


def _job_id(msg: Delivery, task: Task) -> int:
    if isinstance(msg, AntennaDelivery):
        return msg.job_id
    return int(task.job_id)


def _deadline(msg: Delivery) -> float:
    if isinstance(msg, AntennaDelivery):
        return msg.expires_at
    return time.monotonic() + 60.0
