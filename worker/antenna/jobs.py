"""Which Antenna jobs to reserve from, in turn.

Antenna lists one random job per call unless it is given ``limit``, and its
``incomplete_only`` still lists jobs that serve no tasks (CREATED, PENDING, CANCELING): the
jobs are listed with ``limit`` every ``poll_interval_s``, each one's status read, and only
STARTED and RETRY jobs of the served pipelines kept (a task of a pipeline this process does
not serve is never reserved). ``next_jobs`` hands them out in turn, starting after the job
served last, so every active job gets a reservation before any gets a second one; a job that
had nothing to give is skipped until the next poll.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import structlog

from worker.antenna.client import AntennaClient, AntennaUnreachable

log = structlog.get_logger(__name__)
ACTIVE = frozenset({"STARTED", "RETRY"})


@dataclass(frozen=True)
class Job:
    id: int
    pipeline: str


class JobRotation:
    def __init__(
        self, client: AntennaClient, pipelines: tuple[str, ...], poll_interval_s: float, limit: int
    ) -> None:
        self._client = client
        self._pipelines = pipelines
        self._poll_interval_s = poll_interval_s
        self._limit = limit
        self._jobs: list[Job] = []
        self._empty_until: dict[int, float] = {}
        self._last: int | None = None
        self._listed_at = float("-inf")
        self.unreachable_since: float | None = None
        self.last_refusal: str | None = None  # a 401/403 on listing: the token

    def due(self) -> bool:
        return time.monotonic() - self._listed_at >= self._poll_interval_s

    async def refresh(self) -> list[Job]:
        """List the incomplete jobs of our pipelines and keep the active ones. On a failure
        the jobs known stay as they were until the next poll."""
        self._listed_at = time.monotonic()
        try:
            listed = await self._listed()
            details = {job.id: await self._detail(job.id) for job in listed}
        except AntennaUnreachable as error:
            if self.unreachable_since is None:
                self.unreachable_since = time.monotonic()
            log.warning(
                "antenna_jobs_unreachable", error=str(error), retry_in_s=self._poll_interval_s
            )
            return self._jobs
        self.unreachable_since = None
        active = [
            ours
            for job in listed
            if details[job.id][0] in ACTIVE and (ours := self._ours(job, details[job.id][1]))
        ]
        if [j.id for j in active] != [j.id for j in self._jobs]:
            log.info("antenna_active_jobs", jobs=[j.id for j in active], listed=len(listed))
        self._jobs = active
        self._empty_until = {}
        return active

    async def _listed(self) -> list[Job]:
        params = {
            "pipeline__slug__in": ",".join(self._pipelines),
            "ids_only": 1,
            "incomplete_only": 1,
            "dispatch_mode": "async_api",
            "limit": self._limit,
        }
        reply = await self._client.get("jobs/", "jobs", params)
        self.last_refusal = f"listing jobs: {reply.why()}" if reply.status in (401, 403) else None
        if not reply.ok or not isinstance(reply.body, dict):
            log.warning(
                "antenna_jobs_refused", reason=reply.why(), retry_in_s=self._poll_interval_s
            )
            return self._jobs
        jobs = []
        for item in reply.body.get("results") or []:
            if isinstance(item, dict) and isinstance(item.get("id"), int):
                slug = str(item.get("pipeline_slug") or "")  # "": said by the job itself
                if not slug or slug in self._pipelines:
                    jobs.append(Job(item["id"], slug))
                else:  # Antenna filters by our slugs: a job of another is never reserved from
                    log.warning("antenna_job_not_ours", job_id=item["id"], pipeline=slug)
        count = reply.body.get("count")
        if isinstance(count, int) and count > len(jobs):
            log.warning("antenna_more_jobs_than_listed", count=count, listed=len(jobs))
        return sorted(jobs, key=lambda j: j.id)

    async def _detail(self, job_id: int) -> tuple[str, str]:
        """The job's status and its pipeline's slug ("" when the reply names none)."""
        reply = await self._client.get(f"jobs/{job_id}/", "job")
        if not (reply.ok and isinstance(reply.body, dict)):
            return "", ""
        pipeline = reply.body.get("pipeline")
        slug = reply.body.get("pipeline_slug") or (
            pipeline.get("slug") if isinstance(pipeline, dict) else None
        )
        return str(reply.body.get("status") or ""), str(slug or "")

    def _ours(self, job: Job, detail_slug: str) -> Job | None:
        """``job`` with its pipeline, when it is one we serve. An Antenna whose jobs list
        leaves ``pipeline_slug`` out (its ids-only serializer gave ``id`` alone) names it in
        the job itself; when neither does, a worker of one pipeline takes the job as its own
        (Antenna listed it for that slug), one of several cannot tell and leaves it."""
        slug = (
            job.pipeline or detail_slug or (self._pipelines[0] if len(self._pipelines) == 1 else "")
        )
        if slug in self._pipelines:
            return Job(job.id, slug)
        log.warning("antenna_job_not_ours", job_id=job.id, pipeline=slug or None)
        return None

    def next_jobs(self) -> list[Job]:
        """The active jobs that may have tasks, starting after the one served last."""
        now = time.monotonic()
        ready = [j for j in self._jobs if self._empty_until.get(j.id, 0.0) <= now]
        if self._last is not None:
            after = [j for j in ready if j.id > self._last]
            ready = after + [j for j in ready if j.id <= self._last]
        return ready

    def served(self, job: Job) -> None:
        self._last = job.id

    def empty(self, job: Job) -> None:
        """``job`` gave nothing (done, paused, or reserved by others): skip it until the next
        poll."""
        self._empty_until[job.id] = self._listed_at + self._poll_interval_s

    def any_ready(self) -> bool:
        return bool(self.next_jobs())
