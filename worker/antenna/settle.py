"""The Antenna source's settler: the core's verdict on a reserved task, carried out.

Antenna's result post is the result store and the ack in one; it has no nak. So:

- a task left for another delivery (the core's retry: a transient failure before the last of
  Antenna's ``max_deliver`` deliveries, 2 by default, counted in the task's reply subject) is
  left to Antenna's redelivery: nothing is posted, and the log says so;
- a kept result is posted; an error result always with ``image_id`` (Antenna marks the image
  failed; without ``image_id`` it would stay pending);
- a result is checked against what this worker registers for the task's pipeline (its job's,
  from the ``Catalog``) before it is posted; one Antenna would accept and then drop becomes
  an error result naming why;
- a result that cannot be posted (``PostFailed``) leaves its task to redelivery.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog

from config.names import env_name
from worker.antenna.answers import usable_reply_subject
from worker.antenna.catalog import Catalog
from worker.antenna.post import Poster, PostFailed
from worker.antenna.render import Entry, OkEntry, error_entry, fit, ok_entry, problems
from worker.antenna.reservations import AntennaDelivered, Reservation
from worker.core.results import Kept, Result, Settled, ran_out
from worker.core.tasks import Task
from worker.core.verdicts import Decision, Verdict

log = structlog.get_logger(__name__)
_REDELIVERY = "left to Antenna's redelivery"


@dataclass
class AntennaSettler:
    poster: Poster
    catalog: Catalog
    max_post_bytes: int

    async def settle(self, delivered: AntennaDelivered, verdict: Verdict) -> Settled:
        reservation = delivered.handle
        decision = verdict.decision
        if decision is Decision.KEEP:
            if verdict.result is None:
                raise ValueError("a keep verdict carries its result")
            result = verdict.result
            entry, kind, why = self._entry(result)
            return await self._post(reservation, result.task, result.attempt, entry, kind, why)
        if decision is Decision.RETRY:
            reservation.left_to_redelivery()
            log.info(
                "task_retried",
                **_named(delivered),
                attempt=delivered.delivered,
                reason=verdict.reason or None,
                how=_REDELIVERY,
            )
            return Settled(Kept.RETRIED)
        if decision is Decision.UNNAMED:
            return await self._unnamed(delivered, verdict.reason)
        if decision is Decision.DONE_BEFORE:  # never asked: Antenna cannot say
            reservation.posted()
            return Settled(Kept.DONE_BEFORE)
        reservation.left_to_redelivery()  # no call gives a reservation back
        return Settled(Kept.GIVEN_BACK)

    async def keep_alive(self, delivered: AntennaDelivered) -> None:
        """Antenna has no call to extend a reservation."""

    async def _post(
        self,
        reservation: Reservation,
        task: Task,
        attempt: int,
        unfit: Entry | OkEntry,
        kind: str,  # "ok", or the error result's kind (``config.errors.ErrorKind``)
        why: str,
    ) -> Settled:
        bound = log.bind(
            task_id=task.id, job_id=task.job_id, image_id=task.image_id, attempt=attempt
        )
        entry, steps = fit(task, unfit, self.max_post_bytes, self.poster.envelope_bytes)
        if steps:
            bound.warning("result_made_smaller", steps=steps)
            if "error_result" in steps:
                kind, why = "result_too_large", entry.error or ""
        late_s = -reservation.seconds_left()
        if late_s > 0:  # posted all the same: an identical repost is harmless in Antenna
            bound.warning(
                "result_posted_after_ttr",
                late_by_s=round(late_s, 1),
                hint=f"Antenna may have delivered the task again meanwhile; if this is seen "
                f"often, {env_name('antenna', 'ttr_s')} may be longer than Antenna's "
                "NATS_TASK_TTR, or the work slower than the TTR allows",
            )
        try:
            posted = await self.poster.post(reservation.job, task, entry, reservation.expires_at)
        except PostFailed as failed:
            reservation.left_to_redelivery()
            bound.warning("result_not_posted", reason=str(failed), how=_REDELIVERY)
            return Settled(Kept.RETRIED)
        reservation.posted()
        if posted is not entry:  # replaced by an error result after Antenna refused it
            kind, why = "http_error", str(posted.error)
        if kind == "ok":
            return Settled(Kept.OK, detections=posted.detections, task=task)
        return Settled(Kept.ERROR, error_type=kind, error=why or None, task=task)

    def _entry(self, result: Result) -> tuple[Entry | OkEntry, str, str]:
        """The item to post for ``result``: "ok", or its error's kind, and why."""
        task = result.task
        if result.failure is not None:
            failure = result.failure  # Antenna's error field names the kind, then the message
            message = f"{failure.kind}: {failure.message}"
            if result.ran_out:
                message = ran_out(result.attempt, message)
            return error_entry(task, message), failure.kind, message
        slug = task.pipeline
        served = self.catalog.get(slug)
        if served is None:  # not made by loaded models: cannot be
            message = f"pipeline {slug!r} has no loaded models to name in the result"
            return error_entry(task, message), "internal_error", message
        found = problems(result, served)
        if found:
            message = "Antenna would not save this result: " + "; ".join(found)
            return error_entry(task, message), "invalid_model_output", message
        return ok_entry(task, result, served, slug), "ok", ""

    async def _unnamed(self, delivered: AntennaDelivered, reason: str) -> Settled:
        """A task too broken to name itself (no usable ``id``). With a usable reply subject it
        still gets its error result (with its image, when it names one); without one nothing
        can be posted: logged, and Antenna delivers it again once and then drops it."""
        reservation = delivered.handle
        if usable_reply_subject(reservation.reply_subject):
            task = Task(
                "",
                str(reservation.job),
                reservation.image_id,
                "",
                reply_subject=reservation.reply_subject,
                pipeline=reservation.pipeline or self.catalog.default,
            )
            message = f"invalid_task: {reason}"
            entry = error_entry(task, message)
            kind = "invalid_task"
            return await self._post(reservation, task, delivered.delivered, entry, kind, message)
        log.error(
            "antenna_task_unusable",
            reason=reason,
            **delivered.log_fields,
            action="left to Antenna's redelivery; no reply subject to post a result to",
        )
        reservation.posted()  # its end is recorded: logged
        return Settled(Kept.DEAD_LETTERED)


def _named(delivered: AntennaDelivered) -> dict[str, Any]:
    """How a log line names a reserved task: its ids when it names them, else its job and
    image as reserved."""
    task = delivered.read.task
    if task is None:
        return dict(delivered.log_fields)
    return {"task_id": task.id, "job_id": task.job_id, "image_id": task.image_id}
