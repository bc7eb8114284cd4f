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

from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from config.errors import Failure
from worker.antenna.answers import usable_reply_subject
from worker.antenna.catalog import Catalog
from worker.antenna.post import Poster, PostFailed
from worker.antenna.render import error_result, fit, item, ok_result, problems
from worker.antenna.reservations import AntennaDelivery
from worker.core.outcome import Outcome
from worker.core.ports import Delivery
from worker.core.tasks import Task
from worker.core.verdicts import ResultMaker, log_task_done, ran_out, retries

log = structlog.get_logger(__name__)


@dataclass
class AntennaRules:
    poster: Poster
    catalog: Catalog
    max_post_bytes: int
    count: Callable[[str], None] = lambda _outcome: None
    documents: ResultMaker = field(default_factory=ResultMaker)  # model: Antenna's own

    async def settle(self, task: Task, delivery: Delivery, outcome: Outcome) -> str:
        reserved = _own(delivery)
        bound = log.bind(
            task_id=task.id, job_id=task.job_id, image_id=task.image_id, attempt=reserved.delivered
        )
        if retries(outcome, reserved):
            await reserved.nak()
            bound.info(
                "task_retried",
                reason=outcome.failure.message if outcome.failure else None,
                how="left to Antenna's redelivery",
            )
            self.count("retried")
            return "retried"
        result, status, why = self._result(task, reserved.delivered, outcome)
        entry, steps = fit(
            task, item(task, result), self.max_post_bytes, self.poster.envelope_bytes
        )
        if steps:
            bound.warning("result_made_smaller", steps=steps)
            if "error_result" in steps:
                status, why = "error", entry["result"]["error"]
        try:
            posted = await self.poster.post(reserved.job, task, entry, reserved.expires_at)
        except PostFailed as failed:
            await reserved.nak()
            bound.warning(
                "result_not_posted", reason=str(failed), how="left to Antenna's redelivery"
            )
            self.count("retried")
            return "retried"
        await reserved.ack()
        if posted is not entry:  # replaced by an error result after Antenna refused it
            status, why = "error", str(posted["result"].get("error"))
        self.count(status)
        detections = len(posted["result"].get("detections") or []) if status == "ok" else 0
        log_task_done(bound, status, outcome.timings_s, detections=detections, error=why or None)
        return status

    def _result(self, task: Task, delivered: int, outcome: Outcome) -> tuple[dict, str, str]:
        """The result to post, its status, and why when it is an error."""
        if outcome.failure is not None:
            failure = outcome.failure  # Antenna's error field names the kind, then the message
            message = f"{failure.kind}: {failure.message}"
            if failure.retryable:
                message = ran_out(delivered, message)
            return error_result(task, message), "error", message
        slug = task.pipeline
        shaped = self.documents.make(task, delivered, outcome)
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

    async def already_stored(self, delivery: Delivery, task: Task) -> None:
        """Never asked: Antenna cannot say whether a task's result is saved."""
        await delivery.ack()

    async def give_back(self, delivery: Delivery) -> None:
        """Antenna has no nak: the reservation runs out and the task is delivered again."""
        await delivery.nak()

    async def dead_letter(self, delivery: Delivery, reason: str) -> str:
        """A task too broken to name itself (no usable ``id``). With a usable reply subject it
        still gets its error result (with its image, when it names one); without one nothing
        can be posted: logged, and Antenna delivers it again once and then drops it."""
        reserved = _own(delivery)
        if usable_reply_subject(reserved.reply_subject):
            task = Task(
                "",
                reserved.job_id,
                reserved.image_id,
                "",
                reply_subject=reserved.reply_subject,
                pipeline=reserved.pipeline or self.catalog.default,
            )
            return await self.settle(
                task, reserved, Outcome(failure=Failure("invalid_task", reason))
            )
        log.error(
            "antenna_task_unusable",
            reason=reason,
            **reserved.log_fields(),
            action="left to Antenna's redelivery; no reply subject to post a result to",
        )
        await reserved.term()
        self.count("dead_lettered")
        return "dead_lettered"


def _own(delivery: Delivery) -> AntennaDelivery:
    """``delivery`` as this room's: the Antenna rules settle only Antenna's reservations."""
    if not isinstance(delivery, AntennaDelivery):
        raise TypeError(f"not an Antenna reservation: {type(delivery).__name__}")
    return delivery
