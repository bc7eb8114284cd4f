"""Reservations from Antenna's active jobs, in turn: the Antenna ``TaskSource``.

``fetch(n)`` reserves at most ``n`` tasks (the room the orchestrator has), fewer when
``Reservations.allowed`` says more could not be finished within ``finish_within_s`` of their
reservation, from the next active job in turn (``JobRotation``). Each call returns within
about ``wait_s``: the jobs are listed at most every ``poll_interval_s``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import structlog

from config.names import env_name
from config.redact import shorten
from worker.antenna.answers import task_problem, usable_reply_subject
from worker.antenna.client import AntennaClient, AntennaUnreachable, Unanswered
from worker.antenna.job_listing import Job, JobRotation
from worker.antenna.reservations import (
    AntennaDelivered,
    Reservation,
    Reservations,
    delivered_of,
)
from worker.core.ports import Delivered, Runnable
from worker.core.tasks import read_task

log = structlog.get_logger(__name__)
_UNAVAILABLE_BACKOFF_S = 2.0


class AntennaSource:
    def __init__(
        self,
        client: AntennaClient,
        jobs: JobRotation,
        reservations: Reservations,
        *,
        reservation_size: int,
        wait_s: float,
        max_deliver: int,
        idle_wait_s: float = 0.0,
        client_info: dict[str, Any] | None = None,
        unreachable_wait_s: float = 0.0,
        default_pipeline: str = "",
    ) -> None:
        self._client = client
        self._client_info = client_info  # sent with each reservation (Antenna's client_info)
        self._jobs = jobs
        self.reservations = reservations
        self._size = reservation_size
        self._wait_s = wait_s
        self._max_deliver = max_deliver
        self._default_pipeline = default_pipeline  # a job naming no pipeline (never, as listed)
        self._closed = False
        self._dry = False  # the last round found no task in any active job
        # ``idle``: how long active jobs may stay listed and give nothing before a burst run
        # gives up on them; since when they have (None: a task came, or no job is listed).
        self._idle_wait_s = idle_wait_s
        # How long listings may find Antenna unavailable before a burst run takes it as idle
        # (and, never answered, ends NOT_SERVED): a restart is ridden out.
        self._unreachable_wait_s = unreachable_wait_s
        self._nothing_since: float | None = None
        self.last_refusal: str | None = None  # a 401/403 on reserving: for /healthz and logs

    def refusal(self) -> str | None:
        """Antenna's last 401/403 (listing or reserving): our token, or its permissions; and
        each project of ``WORKER_ANTENNA__PROJECT_IDS`` whose listing it refused."""
        return self.last_refusal or self._jobs.last_refusal

    async def fetch(
        self, batch: int, runnable: Runnable | None = None, available: Runnable | None = None
    ) -> list[AntennaDelivered]:
        """Up to ``batch`` reserved tasks; [] within about ``wait_s`` when there are none.
        Nothing is reserved from jobs of a pipeline ``available`` says no to (its models
        cannot be loaded here: what it reserved could only be left to redelivery)."""
        if self._closed:
            return []
        wanted = min(batch, self._size, self.reservations.allowed())
        if wanted <= 0:
            await asyncio.sleep(min(self._wait_s, 0.2))
            return []
        if self._jobs.due():
            await self._jobs.refresh()
        jobs = self._jobs.next_jobs()
        if available is not None:
            jobs = [job for job in jobs if available(job.pipeline)]
        if runnable is not None:  # the jobs of pipelines that can run now first
            jobs.sort(key=lambda job: not runnable(job.pipeline))
        for job in jobs:
            got = await self._reserve(job, wanted)
            if got:
                self._jobs.reserved_from(job)
                self._dry, self._nothing_since = False, None
                return got
            self._jobs.empty(job)
        # A round while tasks are held here says nothing of idle, and the wait for tasks out
        # elsewhere counts only from a round with none held.
        self._dry = not len(self.reservations)
        if not self._dry or not self._jobs.active_ids():
            self._nothing_since = None
        elif self._nothing_since is None:
            self._nothing_since = time.monotonic()
        await asyncio.sleep(self._wait_s)
        return []

    async def _reserve(self, job: Job, wanted: int) -> list[AntennaDelivered]:
        asked: dict[str, Any] = {"batch_size": wanted}
        if self._client_info is not None:
            asked["client_info"] = self._client_info
        body = json.dumps(asked).encode()
        try:
            reply = await self._client.post(f"jobs/{job.id}/tasks/", "tasks", body)
        except Unanswered as error:  # not asked again: that would reserve twice
            _say_unanswered(job, wanted, str(error))
            await asyncio.sleep(_UNAVAILABLE_BACKOFF_S)
            return []
        except asyncio.CancelledError:  # a stop whose drain ended before Antenna answered
            _say_unanswered(job, wanted, "the drain ended before Antenna answered")
            raise
        except AntennaUnreachable as error:
            log.warning("antenna_reserve_unreachable", job_id=job.id, error=str(error))
            await asyncio.sleep(_UNAVAILABLE_BACKOFF_S)
            return []
        reserved_at = time.monotonic()
        if reply.status in (401, 403):
            self.last_refusal = f"reserving from job {job.id}: {reply.why()}"
            log.error(
                "antenna_refused_reservation",
                job_id=job.id,
                reason=reply.why(),
                hint=f"check {env_name('antenna', 'token')} and the token's project permissions",
            )
            return []
        if not reply.ok or not isinstance(reply.body, dict):
            log.warning("antenna_reserve_failed", job_id=job.id, reason=reply.why())
            if reply.status == 503:
                await asyncio.sleep(_UNAVAILABLE_BACKOFF_S)
            return []
        self.last_refusal = None
        tasks = reply.body.get("tasks") or []
        got = [d for t in tasks if (d := self._checked(job, t, reserved_at)) is not None]
        if len(tasks) > wanted:
            log.warning("antenna_reserved_more_than_asked", asked=wanted, got=len(tasks))
        return got

    def _checked(self, job: Job, task: object, reserved_at: float) -> AntennaDelivered | None:
        """One reserved task as a delivery, checked on its own. One that does not fit
        (``answers.ReservedTask``) is still a delivery when its reply subject is usable:
        admission reads it as any task and gives it its error result. One without a usable
        reply subject is logged and skipped: no result posted for it could be acked."""
        fields: dict[str, Any] = task if isinstance(task, dict) else {}
        problem = task_problem(task)
        if problem is None:
            return self._delivery(job, fields, reserved_at)
        image_id = _shown_id(fields.get("image_id"))
        if usable_reply_subject(fields.get("reply_subject")) is not None:
            log.warning(
                "antenna_task_malformed",
                job_id=job.id,
                image_id=image_id,
                reason=problem,
                action="read as any task: an error result when it cannot be run",
            )
            return self._delivery(job, fields, reserved_at)
        log.warning(
            "antenna_task_skipped",
            job_id=job.id,
            image_id=image_id,
            reason=problem,
            action="no reply subject to post a result to: left to Antenna's redelivery",
        )
        return None

    def _delivery(self, job: Job, task: dict[str, Any], reserved_at: float) -> AntennaDelivered:
        """A reserved task read once (``tasks.read_task``, from Antenna's decoded answer), with
        its reservation as the handle. Antenna's tasks name no job: the job they were reserved
        from is theirs."""
        reply_subject = str(task.get("reply_subject") or "")
        image_id = str(task.get("image_id") or "")
        reservation = Reservation(
            job=job.id,
            pipeline=job.pipeline,
            image_id=image_id,
            reply_subject=reply_subject,
            reserved_at=reserved_at,
            expires_at=reserved_at + self.reservations.ttr_s,
            on_settled=self.reservations.settled,
        )
        self.reservations.add(reservation)
        delivered = delivered_of(reply_subject, unknown=self._max_deliver)
        payload = {**task, "job_id": str(job.id)}
        return Delivered(
            read=read_task(payload, job.pipeline, str(job.id), self._default_pipeline),
            delivered=delivered,
            deliveries_left=max(0, self._max_deliver - delivered),
            handle=reservation,
            log_fields={"job_id": job.id, "image_id": image_id},
        )

    async def close(self) -> list[AntennaDelivered]:
        """Reserve nothing more. Nothing arrives unasked over HTTP: nothing to hand back."""
        self._closed = True
        return []

    async def idle(self) -> bool:
        """Nothing held, and the last round of the active jobs gave nothing: with no active
        job listed, or with jobs listed that gave nothing for ``idle_wait_s`` (their tasks are
        out: ``still_out`` says which). Never while listings have found Antenna unavailable,
        or a listed job's own page could not be read, for less than ``unreachable_wait_s``."""
        if not self._dry or len(self.reservations):
            return False
        for failing_s in (self._jobs.failing_for_s(), self._jobs.unread_for_s()):
            if failing_s is not None and failing_s < self._unreachable_wait_s:
                return False  # not known idle: Antenna may be restarting
        return self._nothing_since is None or self.still_out() is not None

    def still_out(self) -> str | None:
        """Why a burst run ends unserved with jobs still active: they gave no task for
        ``idle_wait_s``; None while they may still (or when none is listed)."""
        since, jobs = self._nothing_since, self._jobs.active_ids()
        if since is None or not jobs or time.monotonic() - since < self._idle_wait_s:
            return None
        shown = ", ".join(map(str, jobs[:10])) + (
            f" and {len(jobs) - 10} more" if len(jobs) > 10 else ""
        )
        return (
            f"Antenna still lists job(s) {shown} as active, and none gave a task for "
            f"{time.monotonic() - since:.0f}s: their tasks are out (held by another process, or "
            f"left by one that stopped, until Antenna delivers them again after "
            f"{env_name('antenna', 'ttr_s')})"
        )


def _say_unanswered(job: Job, asked: int, why: str) -> None:
    """A reservation sent that got no answer: Antenna may have reserved tasks for it, which
    no worker sees until they come back."""
    log.warning(
        "antenna_reservation_unanswered",
        job_id=job.id,
        asked=asked,
        error=why,
        action="left to Antenna's redelivery",
        hint=f"any task Antenna reserved in it comes back after {env_name('antenna', 'ttr_s')}",
    )


def _shown_id(value: object) -> str | None:
    """An id from a task as a log line may show it: a string or an integer, capped."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None
    return shorten(str(value), 100)
