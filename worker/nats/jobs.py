"""Fair share on NATS: one durable pull consumer per job, so a small job is never stuck behind
the stream order of a big one.

The tasks stream delivers in publish order through one consumer, and the held-task cap fills
with whatever came first: behind a 100,000-task job a 5-task job would not even be fetched.
So every job subject ``tasks.<pipeline>.<job>`` of a served pipeline gets a consumer of its
own, filtered to that subject and shared by every worker process (its name is made from the
subject: ``<WORKER_NATS__CONSUMER>-job-<sha256 of the subject, 16 hex>``, its description is
the subject). Jobs are discovered from the stream's subjects (``stream_info`` with a subjects
filter, one request per served pipeline) every ``WORKER_NATS__JOB_DISCOVERY_S``, and at
once when a task of a job not served yet is heard of (``worker.nats.news``); the
consumers' pending counts come from one consumer listing. Each fetch takes from the jobs
with tasks pending (or awaiting an ack: redeliveries come from there) in rotation, an equal
share each, concurrently (and from the durable consumer for
``tasks.<pipeline>``, the job in the payload), so the held tasks hold every job's; the
orchestrator's fair share then forms the batches.

Cleanup: the server deletes a job's consumer once no worker has pulled from it for
``WORKER_NATS__JOB_CONSUMER_INACTIVE_S`` (``inactive_threshold``; by default the tasks'
``max_age``, so a consumer outlives its job's messages and is never made again for a job
that is done). Should one be made again (its job's messages still there, a new release
reading an old stream), it walks its job from the start: a task whose result is already
stored is only acked (admission checks every task), so nothing runs twice.

Limits: ``WORKER_NATS__MAX_JOB_CONSUMERS`` jobs are served at once per process (oldest
discovered first; the rest wait for a slot); a subject listing holds at most the server's
page of subjects (100,000) per pipeline; consumers are listed 256 per request.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass
from typing import Any

import nats
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from config.settings import NatsSettings
from worker.nats.provision import task_consumer_config
from worker.nats.subjects import job_tasks_subject, tasks_subject
from worker.ports import Runnable

log = structlog.get_logger(__name__)
_PAGE = 256
_MAX_PAGES = 64


def job_consumer(settings: NatsSettings, subject: str) -> str:
    """The consumer of one job subject: the same name in every worker process."""
    digest = hashlib.sha256(subject.encode()).hexdigest()[:16]
    return f"{settings.consumer}-job-{digest}"


def is_job_consumer(settings: NatsSettings, name: str) -> bool:
    """Whether ``name`` is one of our job consumers' (``job_consumer``'s form)."""
    prefix = f"{settings.consumer}-job-"
    digest = name.removeprefix(prefix)
    return (
        name.startswith(prefix)
        and len(digest) == 16
        and all(c in "0123456789abcdef" for c in digest)
    )


def job_consumer_config(settings: NatsSettings, subject: str) -> api.ConsumerConfig:
    return task_consumer_config(
        settings,
        job_consumer(settings, subject),
        description=subject,
        filter_subject=subject,
        inactive_threshold=settings.job_consumer_inactive_s or settings.tasks_max_age_s,
    )


@dataclass
class JobSource:
    subject: str
    name: str
    pending: int  # not yet delivered, as last listed
    ack_pending: int
    pipeline: str = ""  # the subject's tasks.<pipeline>.<job>
    sub: Any = None  # bound while the job has tasks pending or awaiting an ack
    dry: bool = False  # its last fetch found nothing: skipped until the next listing


class JobConsumers:
    """The job consumers of the served pipelines: discovered, made, bound while they have
    work, and handed out in rotation."""

    def __init__(self, js: JetStreamContext, settings: NatsSettings, pipelines: list[str]):
        self._js = js
        self._settings = settings
        self._pipelines = pipelines
        self._jobs: dict[str, JobSource] = {}  # by subject, in discovery order
        self._turn = 0
        self._refreshed_at = float("-inf")
        self.main_pending = False  # the durable consumer (job in the payload) has tasks
        self.news = asyncio.Event()  # a task was heard of on a subject not served yet
        self._main_subjects = {tasks_subject(p) for p in pipelines}

    def due(self) -> bool:
        return time.monotonic() - self._refreshed_at >= self._settings.job_discovery_s

    def heard(self, subject: str) -> None:
        """A task was published on ``subject`` (``worker.nats.news``): a job subject not
        served yet makes the discovery due now; one on ``tasks.<pipeline>`` marks the durable
        consumer as having work. Wakes an idle fetch either way."""
        if subject in self._jobs:
            return
        if subject in self._main_subjects:  # tasks.<pipeline>: the durable consumer's
            self.main_pending = True
        else:
            self._refreshed_at = float("-inf")
        self.news.set()

    async def news_within(self, timeout_s: float) -> bool:
        """Whether a task was heard of (since the last call) within ``timeout_s``."""
        try:
            await asyncio.wait_for(self.news.wait(), max(0.0, timeout_s))
        except TimeoutError:
            return False
        self.news.clear()
        return True

    def until_due(self) -> float:
        """Seconds until the next discovery is due (0 when it is)."""
        waited = time.monotonic() - self._refreshed_at
        return max(0.0, self._settings.job_discovery_s - waited)

    async def refresh(self) -> list[Msg]:
        """Discover jobs, make the consumers they lack, bind those with pending tasks and
        unbind the others; returns what unbound subscriptions had received after their last
        fetch (to be admitted like any fetched message). A NATS error changes nothing."""
        self._refreshed_at = time.monotonic()
        try:
            subjects = await self._subjects()
            listed = await self._listed()
            main = listed.get(self._settings.consumer)
            self.main_pending = bool(main is not None and main.num_pending)
            for subject in subjects:
                await self._note(subject, listed)
            return await self._bind_or_unbind()
        except (nats.errors.Error, TimeoutError) as error:
            log.warning("job_discovery_failed", error=f"{type(error).__name__}: {error}")
            return []

    async def _note(self, subject: str, listed: dict[str, api.ConsumerInfo]) -> None:
        """One job subject: its consumer made when it has none; tracked while it has work."""
        name = job_consumer(self._settings, subject)
        info = listed.get(name)
        if info is None:
            config = job_consumer_config(self._settings, subject)
            info = await self._js.add_consumer(self._settings.tasks_stream, config)
            log.info("job_consumer_made", consumer=name, subject=subject)
        job = self._jobs.get(subject) or JobSource(subject, name, 0, 0, subject.split(".")[1])
        job.pending, job.ack_pending = info.num_pending or 0, info.num_ack_pending or 0
        job.dry = False
        if job.pending or job.ack_pending or job.sub is not None:
            self._jobs[subject] = job

    def active(self, runnable: Runnable | None = None) -> list[JobSource]:
        """Bound jobs worth a fetch, rotated one place per call: each fetch starts with the
        next job. Only those of ``runnable`` pipelines while any of them has one."""
        bound = [job for job in self._jobs.values() if job.sub is not None and not job.dry]
        if runnable is not None:
            bound = [job for job in bound if runnable(job.pipeline)] or bound
        if not bound:
            return []
        self._turn = (self._turn + 1) % len(bound)
        return bound[self._turn :] + bound[: self._turn]

    async def busy_now(self) -> bool:
        """Any job consumer of ours with tasks pending or awaiting an ack (listed now)."""
        prefix = f"{self._settings.consumer}-job-"
        return any(
            info.num_pending or info.num_ack_pending
            for name, info in (await self._listed()).items()
            if name.startswith(prefix)
        )

    async def close(self) -> list[Msg]:
        late: list[Msg] = []
        for job in self._jobs.values():
            late += await self._unbind(job)
        return late

    async def _subjects(self) -> list[str]:
        found: list[str] = []
        for pipeline in self._pipelines:
            info = await self._js.stream_info(
                self._settings.tasks_stream, subjects_filter=job_tasks_subject(pipeline, "*")
            )
            found += sorted((info.state.subjects or {}).keys())
        return found

    async def _listed(self) -> dict[str, api.ConsumerInfo]:
        """Every consumer of the tasks stream, by name (paged)."""
        listed: dict[str, api.ConsumerInfo] = {}
        for page in range(_MAX_PAGES):
            infos = await self._js.consumers_info(self._settings.tasks_stream, offset=page * _PAGE)
            listed.update((info.name, info) for info in infos)
            if len(infos) < _PAGE:
                break
        return listed

    async def _bind_or_unbind(self) -> list[Msg]:
        """Bound: the jobs with tasks pending or awaiting an ack (a task given back, or whose
        worker died, comes back from there), at most ``max_job_consumers``, the earliest
        discovered first. Jobs with neither are unbound and forgotten."""
        late: list[Msg] = []
        bound = sum(job.sub is not None for job in self._jobs.values())
        for subject, job in list(self._jobs.items()):
            work = job.pending or job.ack_pending
            if work and job.sub is None and bound < self._settings.max_job_consumers:
                job.sub = await self._js.pull_subscribe_bind(
                    durable=job.name, stream=self._settings.tasks_stream
                )
                bound += 1
            elif not work and job.sub is not None:
                late += await self._unbind(job)
                bound -= 1
            if job.sub is None and not job.pending and not job.ack_pending:
                del self._jobs[subject]
        return late

    async def _unbind(self, job: JobSource) -> list[Msg]:
        from worker.nats.feed import late_deliveries

        if job.sub is None:
            return []
        sub, job.sub = job.sub, None
        pending = late_deliveries(sub)
        try:
            await sub.unsubscribe()
        except (nats.errors.Error, TimeoutError):
            pass
        found: list[Msg] = []
        while pending is not None and not pending.empty():
            msg = pending.get_nowait()
            if not JetStreamContext.is_status_msg(msg):
                found.append(msg)
        return found
