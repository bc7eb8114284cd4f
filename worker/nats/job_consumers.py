"""Fair share on NATS: one durable pull consumer per job, so a small job is never stuck behind
the stream order of a big one.

The tasks stream delivers in publish order through one consumer, and the held-task cap fills
with whatever came first: behind a 100,000-task job a 5-task job would not even be fetched.
So every job subject ``tasks.<pipeline>.<job>`` of a served pipeline gets a consumer of its
own while it has work, filtered to that subject and shared by every worker process (its name
is made from the subject: ``<WORKER_NATS__CONSUMER>-job-<sha256 of the subject, 16 hex>``, its
description is the subject). Consumers are made as jobs come and deleted as they finish,
within a bound (``worker.nats.lifecycle``, which composes ``job_discovery``,
``consumer_maker``, ``drift_repair`` and ``consumer_deleter`` around ``job_state``). Every
``WORKER_NATS__JOB_DISCOVERY_S``, and at once when a task of a job not served yet is heard of
(``worker.nats.hints``), one consumer listing gives the job consumers' pending counts. Each
fetch takes from the jobs with tasks pending (or awaiting an ack: redeliveries come from
there) in rotation, an equal share each, concurrently (and from the durable consumer for
``tasks.<pipeline>``, the job in the payload), so the held tasks hold every job's; the
orchestrator's fair share then forms the batches.

Should a job's consumer be made again from its start (a new release reading an old stream),
it walks its job: a task whose result is already stored is only acked (admission checks
every task), so nothing runs twice.

Limits: consumers are listed 256 per request, 64 pages at most (``job_discovery``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import nats
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from config.names import env_name
from config.settings import NatsSettings
from worker.core.ports import Runnable
from worker.nats.consumer_stats import ConsumerStats
from worker.nats.job_discovery import list_consumers
from worker.nats.job_names import is_job_consumer, job_consumer
from worker.nats.late import unsubscribe
from worker.nats.lifecycle import JobLifecycle
from worker.nats.listing_cadence import ListingCadence
from worker.nats.provision import (
    SCOUT_BATCH,
    consumer_names,
    job_consumer_config,
    serves_job_subjects,
)
from worker.nats.subjects import new_jobs_consumer, tasks_subject

log = structlog.get_logger(__name__)
__all__ = [
    "BoundJob",
    "JobConsumers",
    "is_job_consumer",
    "job_consumer",
    "job_consumer_config",
    "job_lifecycle",
]


def job_lifecycle(js: JetStreamContext, settings: NatsSettings) -> JobLifecycle:
    """The job consumers' lifecycle, each of its parts given what it uses of ``settings``."""
    return JobLifecycle(
        js,
        consumer_names(settings),
        config_of=partial(job_consumer_config, settings),
        most=settings.max_job_consumers,
        linger_s=settings.job_consumer_linger_s,
        fetch_timeout_s=settings.fetch_timeout_s,
    )


@dataclass
class BoundJob:
    subject: str
    name: str
    pending: int  # not yet delivered, as last listed
    ack_pending: int
    pipeline: str = ""  # the subject's tasks.<pipeline>.<job>
    sub: Any = None  # bound while the job has tasks pending or awaiting an ack
    dry: bool = False  # its last fetch came back short: skipped until listed or heard of


class JobConsumers:
    """The job consumers of the served pipelines: discovered, made, bound while they have
    work, and handed out in rotation."""

    def __init__(self, js: JetStreamContext, settings: NatsSettings, pipelines: list[str]):
        self._js = js
        self._settings = settings
        self._names = consumer_names(settings)
        self._life = job_lifecycle(js, settings)
        self._jobs: dict[str, BoundJob] = {}  # by subject, in discovery order
        self._turn = 0
        self._refreshed_at = float("-inf")
        self.main_pending = False  # the durable consumer (job in the payload) has tasks
        self.hint = asyncio.Event()  # a task was heard of on a subject not served yet
        self._main_subjects = {tasks_subject(p) for p in pipelines}
        self._conflict_logged = False
        self._hinted = False  # a job not served yet was heard of since the last discovery
        self._hinted_new: dict[str, None] = {}  # those jobs' subjects (SCOUT_BATCH at most)
        self._from_hints: dict[str, api.ConsumerInfo] = {}  # made for them, not yet scouted
        self._bind_first = False  # some made for them: bound before the new-jobs read
        self.cadence = ListingCadence(settings.job_discovery_s, settings.job_discovery_idle_s)
        self.hints_whole: Callable[[], bool] = lambda: False  # the feed's NewJobHints.whole

    def due(self) -> bool:
        return self._hinted or self.due_by_time()

    def due_by_time(self) -> bool:
        return time.monotonic() - self._refreshed_at >= self.cadence.interval_s

    def hinted(self, subject: str) -> None:
        """A task was published on ``subject`` (``worker.nats.hints``): a job subject not
        served yet makes the discovery due now; one on ``tasks.<pipeline>`` marks the durable
        consumer as having work. Wakes an idle fetch either way."""
        if subject in self._jobs:
            self._jobs[subject].dry = False  # more of it to fetch
            return
        if subject in self._main_subjects:  # tasks.<pipeline>: the durable consumer's
            self.main_pending = True
        else:
            self._hinted = True
            if len(self._hinted_new) < SCOUT_BATCH:  # the others: found by the new-jobs read
                self._hinted_new[subject] = None
        self.hint.set()

    async def hint_within(self, timeout_s: float) -> bool:
        """Whether a task was heard of (since the last call) within ``timeout_s``."""
        try:
            await asyncio.wait_for(self.hint.wait(), max(0.0, timeout_s))
        except TimeoutError:
            return False
        self.hint.clear()
        return True

    async def hints_quiet(self, quiet_s: float, most_s: float) -> None:
        """Wait until no task has been heard of for ``quiet_s``, ``most_s`` at most."""
        deadline = time.monotonic() + most_s
        while await self.hint_within(min(quiet_s, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                return

    async def settle_hints(self, quiet_s: float, most_s: float) -> None:
        """Wait until no task has been heard of for ``quiet_s`` (``most_s`` at most) while
        the consumers of the new jobs heard of are made: jobs published together are bound
        for one first fetch, and a job published alone waits for its consumer's creation,
        not for the quiet and then the creation."""
        await asyncio.gather(self.hints_quiet(quiet_s, most_s), self.make_hinted())

    async def make_hinted(self) -> None:
        """The consumers of the new jobs heard of, made (or found: another process heard of
        them too) and noted as having work, so they are bound without waiting on the
        new-jobs read; that read follows at the next discovery (it holds their messages until
        they are delivered). Those that find no room are left to it."""
        if self._conflict_logged or not self._hinted_new:
            return
        subjects, self._hinted_new = list(self._hinted_new), {}
        try:
            ours = await self._life.make_hinted(subjects)
        except (nats.errors.Error, TimeoutError) as error:
            log.warning("job_discovery_failed", error=f"{type(error).__name__}: {error}")
            return
        finally:
            self._pace_refusals()
        self._life.round_done()
        for info in ours.values():
            self._from_hints[info.name] = info
            self._note(info, hinted=True)
        self._bind_first = self._bind_first or bool(ours)
        self._hinted = True  # their new-jobs messages, read at the next discovery

    def until_due(self) -> float:
        """Seconds until the next discovery is due (0 when it is)."""
        waited = time.monotonic() - self._refreshed_at
        return 0.0 if self._hinted else max(0.0, self.cadence.interval_s - waited)

    async def refresh(self) -> list[Msg]:
        """Make the consumers new jobs lack, delete those of finished jobs, bind the jobs with
        tasks pending and unbind the others; returns what unbound subscriptions had received
        after their last fetch (to be admitted like any fetched message). A NATS error
        changes nothing. Woken by a hint between two discoveries, only the new jobs."""
        hinted, self._hinted = self._hinted, False
        scouted: list[Msg] = []
        try:
            if hinted and not self.due_by_time():  # (none while the shared one takes them)
                return [] if self._conflict_logged else await self._new_jobs_only()
            self._refreshed_at = time.monotonic()
            self._hinted_new, self._from_hints, self._bind_first = {}, {}, False  # listed now
            self.cadence.listed(quiet=self._quiet())
            scouted = await self._life.scout()
            listed = await self._listed()  # after the scout read: a job listed has its consumer
            main = listed.get(self._settings.consumer)
            self.main_pending = bool(main is not None and main.num_pending)
            ours = {n: i for n, i in listed.items() if is_job_consumer(self._names, n)}
            if main is not None and self._shared_serves_jobs(main):
                await self._give_back(scouted)
                for job in self._jobs.values():
                    job.pending = job.ack_pending = 0
                return await self._bind_or_unbind()
            self._life.listed(ours)
            await self._life.repair_drift()
            await self._life.make_missing(scouted)
            return await self._settle_listing(scouted)
        except (nats.errors.Error, TimeoutError) as error:
            log.warning("job_discovery_failed", error=f"{type(error).__name__}: {error}")
            await self._life.give_back(scouted)  # for the next discovery, not after 30 s
            return []
        finally:
            self._pace_refusals()

    def _pace_refusals(self) -> None:
        """A job waits for room on the server: its consumer is retried at every listing, so the
        listing keeps its base cadence from the refusal on, also when the refusal came between
        two listings of an idle process (a hinted job's consumer, made at once)."""
        if self._life.refusal is not None:
            self.cadence.worked()

    def _quiet(self) -> bool:
        """Nothing in hand, no job waiting for room on the server (a refused consumer is retried
        at every discovery) and the hints whole: an idle process may list less often."""
        return self._life.empty_handed() and self._life.refusal is None and self.hints_whole()

    async def _new_jobs_only(self) -> list[Msg]:
        """The new-jobs messages waiting, their consumers made (or found: made elsewhere) and
        bound, with no listing. Jobs heard of get theirs first (``make_hinted``), bound at
        once: the new-jobs read waits for the next discovery, after their first fetch."""
        await self.make_hinted()
        hinted = set(self._from_hints)
        if self._bind_first:
            self._bind_first, self._hinted = False, True  # the new-jobs read at the next fetch
            return await self._bind_or_unbind()
        scouted = await self._life.scout()
        known, self._from_hints = self._from_hints, {}
        if not scouted:
            return []
        await self._life.make_missing(scouted, known)
        self._life.round_done()
        for name, info in self._life.consumers.items():
            if name not in hinted:  # (those heard of are noted already, fetched or being)
                self._note(info)
        if self._life.more:
            self._hinted = True
        return await self._bind_or_unbind()

    async def _settle_listing(self, scouted: list[Msg]) -> list[Msg]:
        """After a listing: jobs noted, bound or unbound, finished ones' consumers deleted."""
        ours = self._life.consumers
        for job in self._jobs.values():
            if job.name not in ours:  # deleted by another worker: nothing left to do
                job.pending = job.ack_pending = 0
        for info in ours.values():
            self._note(info)
        late = await self._bind_or_unbind()
        if not scouted:  # new jobs first: their first fetch does not wait on deletes
            bound = {job.name for job in self._jobs.values() if job.sub is not None}
            await self._life.delete_finished(bound)
        self._life.round_done()
        if self._life.more:
            self._refreshed_at = float("-inf")
        return late

    def _shared_serves_jobs(self, main: api.ConsumerInfo) -> bool:
        """The shared consumer delivers job subjects too (provisioned meanwhile by a process
        with FAIR_JOBS=false, of this release or an earlier one): job consumers are not read
        while it does, so no task is delivered by both."""
        conflict = serves_job_subjects(main.config)
        if conflict and not self._conflict_logged:
            log.error(
                "fair_jobs_suspended",
                consumer=self._settings.consumer,
                filter=main.config.filter_subjects,
                hint=f"a process with {env_name('nats', 'fair_jobs')}=false shares this "
                "consumer; job consumers are not read while its filter takes the job subjects",
            )
        self._conflict_logged = conflict
        return conflict

    async def _give_back(self, msgs: list[Msg]) -> None:
        for msg in msgs:
            await msg.nak(delay=self._settings.job_discovery_s)

    def _note(self, info: api.ConsumerInfo, hinted: bool = False) -> None:
        """One job consumer, as listed: tracked while it has work (one made for a task
        ``heard`` of has some, though it may have been made before the task was stored)."""
        subject = info.config.filter_subject or ""
        if not subject.startswith("tasks."):
            return
        job = self._jobs.get(subject) or BoundJob(subject, info.name, 0, 0, subject.split(".")[1])
        job.pending, job.ack_pending = info.num_pending or 0, info.num_ack_pending or 0
        job.pending = max(job.pending, int(hinted))
        job.dry = False
        if job.pending or job.ack_pending or job.sub is not None:
            self._jobs[subject] = job

    async def open(self) -> list[Msg]:
        """The bound read from the server, and every existing job consumer given this
        process's delivery settings (ConfigError when one cannot be), then a discovery."""
        await self._life.open()
        listed = await self._listed()
        await self._life.repair_at_open(
            {n: i for n, i in listed.items() if is_job_consumer(self._names, n)}
        )
        return await self.refresh()

    async def delivered(self, msgs: list[Msg]) -> None:
        """Tasks fetched from job consumers: the new-jobs messages they are past are done."""
        await self._life.delivered(msgs)

    @property
    def stats(self) -> ConsumerStats:
        return self._life.stats

    def problem(self) -> str | None:
        """Why new jobs cannot be served now (the server refused their consumers), or None."""
        return self._life.refusal

    def active(
        self, runnable: Runnable | None = None, available: Runnable | None = None
    ) -> list[BoundJob]:
        """Bound jobs worth a fetch, rotated one place per call: each fetch starts with the
        next job. Only those of ``runnable`` pipelines while any of them has one; never those
        of a pipeline ``available`` says no to (its models cannot be loaded here)."""
        bound = [job for job in self._jobs.values() if job.sub is not None and not job.dry]
        if available is not None:
            bound = [job for job in bound if available(job.pipeline)]
        if runnable is not None:
            bound = [job for job in bound if runnable(job.pipeline)] or bound
        if not bound:
            return []
        self._turn = (self._turn + 1) % len(bound)
        return bound[self._turn :] + bound[: self._turn]

    def share_fetched(self, job: BoundJob, short: bool) -> None:
        """``job``'s share of a fetch came back ``short``: it has no more now (a fetch returns
        what is there at once), so it is not asked again until the next listing, or until a
        task of it is heard of."""
        job.dry = short

    async def busy_now(self) -> bool:
        """Any job consumer of ours with tasks pending or awaiting an ack (listed now)."""
        prefix = f"{self._settings.consumer}-job-"
        scout = new_jobs_consumer(self._names)
        return any(
            info.num_pending or info.num_ack_pending
            for name, info in (await self._listed()).items()
            if name.startswith(prefix) or name == scout
        )

    async def close(self) -> list[Msg]:
        await self._life.close()
        late: list[Msg] = []
        for job in self._jobs.values():
            late += await self._unbind(job)
        return late

    async def _listed(self) -> dict[str, api.ConsumerInfo]:
        """Every consumer of the tasks stream, by name (paged)."""
        return await list_consumers(self._js, self._settings.tasks_stream)

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

    async def _unbind(self, job: BoundJob) -> list[Msg]:
        if job.sub is None:
            return []
        sub, job.sub = job.sub, None
        return await unsubscribe(sub)
