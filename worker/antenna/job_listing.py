"""Which Antenna jobs to reserve from, in turn.

Antenna's jobs list is DRF's limit/offset pagination (``count``, ``next``, ``previous``,
``results``); with ``ids_only`` it answers one random job unless given ``limit``, in a random
order unless given ``ordering``, and it lists each job twice for a token that is not a
superuser's. Its ``incomplete_only`` still lists jobs that serve no tasks (CREATED, PENDING,
CANCELING), so the active ones are listed by ``status`` (STARTED, then RETRY), ordered by
``created_at`` so the pages do not shift under us, every page read (at most ``_MAX_PAGES``),
each job kept once. A job's own page is read only when the list does not name its pipeline
and this process serves several (once per job; one that could not be read is asked again
after a backoff, and is not served meanwhile: ``unread``), so an idle process asks Antenna for about
``2 * pages / poll_interval_s`` listings a second, whatever the number of jobs.

With projects given (``WORKER_ANTENNA__PROJECT_IDS``) only their jobs are listed, one listing
per project (Antenna's jobs list takes one project a call): each page names the project twice,
as ``project_id`` (the active project: it scopes the listing, but an id no project has scopes
nothing, ``ami/base/views.py`` ``get_active_project``) and as ``project`` (the jobs filterset's
field, which answers 400 for an id no project has): a mistyped id is then a refused listing,
never every project's jobs. Without projects every job the token can list is served.

A project whose listing is refused (a 4xx other than 401, 408 and 429: an id no project has, a
deleted project, one the token lost) is left out of that listing and the others are served:
``refused_projects`` names each with Antenna's answer (the source's refusal: /readyz and an
unserved ``--until-idle`` say it). A 401 refuses the token for every project: the listing as a
whole is refused, the jobs known kept.

A listing that finds Antenna unavailable (no answer, one not believed, or a 5xx: a restart, a
proxy with nothing behind it) is tried again after one poll interval, then twice as late each
time, up to ``_FAILING_MAX_POLLS`` intervals (20 s at the default 5 s); ``failing_for_s`` says
for how long listings have failed so (``run --until-idle`` waits
``WORKER_ANTENNA__UNREACHABLE_WAIT_S`` on it). Any other answer ends it.

``next_jobs`` hands the jobs out in turn, starting after the job served last, so every active
job gets a reservation before any gets a second one. A job that had nothing to give is skipped
until the next poll, then for twice as long each time it gives nothing again, up to
``_EMPTY_MAX_POLLS`` poll intervals (60 s at the default 5 s): a process beside N active jobs
that are all empty asks for tasks about ``N / (12 * poll_interval_s)`` times a second.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import structlog

from config.names import env_name
from worker.antenna.answers import Reply
from worker.antenna.client import AntennaClient, AntennaUnreachable

log = structlog.get_logger(__name__)
ACTIVE = ("STARTED", "RETRY")
_MAX_PAGES = 50  # per status: 5,000 jobs at the default page of 100
_EMPTY_MAX_POLLS = 12
_FAILING_MAX_POLLS = 4
_NOT_PROJECT_REFUSALS = (401, 408, 429)  # the token (every project), a timeout, a rate limit


class ProjectRefused(Exception):
    """A named project's listing refused; the others are listed still."""

    def __init__(self, project: int, why: str) -> None:
        super().__init__(why)
        self.project = project
        self.why = why


def project_refusal(project: int | None, reply: Reply) -> ProjectRefused | None:
    """The refusal of ``project``'s listing when ``reply`` is one (a 4xx but 401, 408 and 429,
    for a named project), else None."""
    if project is None or not 400 <= reply.status < 500 or reply.status in _NOT_PROJECT_REFUSALS:
        return None
    why = (
        f"listing project {project}'s jobs: {reply.why()}: check "
        f"{env_name('antenna', 'project_ids')} (no such project, or the token may not use it)"
    )
    return ProjectRefused(project, why)


def project_params(project: int | None) -> dict[str, int]:
    """The jobs listing's query naming one project (see the module's docstring)."""
    return {} if project is None else {"project_id": project, "project": project}


@dataclass(frozen=True)
class Job:
    id: int
    pipeline: str


@dataclass(frozen=True)
class _Unread:
    """A listed job whose own page could not be read: why, since when (``time.monotonic``),
    when it is asked again, and how long after that when it fails again."""

    why: str
    since: float
    next_at: float
    wait_s: float


class JobRotation:
    def __init__(
        self,
        client: AntennaClient,
        pipelines: tuple[str, ...],
        poll_interval_s: float,
        limit: int,
        projects: tuple[int, ...] = (),
    ) -> None:
        self._client = client
        self._pipelines = pipelines
        self._projects = projects
        self._poll_interval_s = poll_interval_s
        self._limit = limit
        self._jobs: list[Job] = []
        self._empty_until: dict[int, float] = {}
        self._empty_for_s: dict[int, float] = {}  # how long the job is skipped when empty again
        self._slugs: dict[int, str] = {}  # a job's pipeline, read from its page once
        self._last: int | None = None
        self._listed_at = float("-inf")
        self._token_refusal: str | None = None  # a 401/403 on listing: the token
        self.refused_projects: dict[int, str] = {}  # by the last listing that answered
        self.ever_listed = False  # a listing answered in full, once at least
        self._failing_since: float | None = None  # listings found Antenna unavailable since
        self._failures = 0  # such listings in a row
        self.last_failure = ""
        # Listed jobs whose own page could not be read (to learn their pipeline), asked again
        # after a backoff: why, since when, when next, the wait after that.
        self._unread: dict[int, _Unread] = {}

    @property
    def last_refusal(self) -> str | None:
        """The token's refusal by the last listing, and each project it refused."""
        said = [self._token_refusal] if self._token_refusal else []
        return "; ".join(said + list(self.refused_projects.values())) or None

    def active_ids(self) -> list[int]:
        """The active jobs of the last listing, skipped ones included."""
        return [job.id for job in self._jobs]

    def longest_skip_s(self) -> float:
        """The longest an empty job goes unasked (then it is asked again)."""
        return _EMPTY_MAX_POLLS * self._poll_interval_s

    def due(self) -> bool:
        return time.monotonic() - self._listed_at >= self._next_listing_s()

    def _next_listing_s(self) -> float:
        """A poll interval; after failed listings, twice as long each, up to 4 intervals."""
        polls = min(2 ** min(self._failures, 8), _FAILING_MAX_POLLS) if self._failures else 1
        return polls * self._poll_interval_s

    def failing_for_s(self) -> float | None:
        """How long every listing has found Antenna unavailable; None when the last answered."""
        since = self._failing_since
        return None if since is None else time.monotonic() - since

    def _failed(self, why: str) -> None:
        if self._failing_since is None:
            self._failing_since = self._listed_at  # from the start of the call that failed
        self._failures += 1
        self.last_failure = why

    def _answered(self) -> None:
        self._failing_since, self._failures = None, 0

    async def refresh(self) -> list[Job]:
        """List the active jobs of our pipelines. On a failure the jobs known stay as they
        were until the next poll."""
        self._listed_at = time.monotonic()
        try:
            listed = await self._listed()
            if listed is None:
                return self._jobs
            active = [ours for job in listed if (ours := await self._ours(job))]
        except AntennaUnreachable as error:  # the client keeps the unreachable clock
            self._failed(str(error))
            log.warning(
                "antenna_jobs_unreachable", error=str(error), retry_in_s=self._next_listing_s()
            )
            return self._jobs
        self._answered()
        self.ever_listed = True
        listed_ids = {job.id for job in listed}
        self._unread = {i: u for i, u in self._unread.items() if i in listed_ids}
        if [j.id for j in active] != [j.id for j in self._jobs]:
            log.info("antenna_active_jobs", jobs=[j.id for j in active], listed=len(listed))
        self._jobs = active
        ids = {j.id for j in active}
        self._empty_for_s = {i: s for i, s in self._empty_for_s.items() if i in ids}
        self._empty_until = {i: t for i, t in self._empty_until.items() if i in ids}
        self._slugs = {i: s for i, s in self._slugs.items() if i in ids}
        return active

    async def _listed(self) -> list[Job] | None:
        """Every active job Antenna lists for our pipelines, once each, by id, from the
        projects that did not refuse their listing; None when Antenna refused the listing."""
        found: dict[int, Job] = {}
        refused: dict[int, str] = {}
        for project in self._projects or (None,):
            try:
                jobs = await self._project_jobs(project)
            except ProjectRefused as error:
                refused[error.project] = error.why
                continue
            if jobs is None:
                return None
            for job in jobs:
                found.setdefault(job.id, job)  # listed twice for a non-superuser
        self._note_refused(refused)
        return sorted(found.values(), key=lambda j: j.id)

    async def _project_jobs(self, project: int | None) -> list[Job] | None:
        """One project's active jobs (every project's for None), every page of each status."""
        jobs: list[Job] = []
        for status in ACTIVE:
            for offset in range(0, _MAX_PAGES * self._limit, self._limit):
                page = await self._page(status, offset, project)
                if page is None:
                    return None
                items, more = page
                jobs += items
                if not more:
                    break
            else:
                log.warning("antenna_jobs_pages_cut", status=status, pages=_MAX_PAGES)
        return jobs

    def _note_refused(self, refused: dict[int, str]) -> None:
        for project in refused.keys() - self.refused_projects.keys():
            log.error(
                "antenna_project_refused",
                project=project,
                reason=refused[project],
                action="its jobs are not served; the other projects' are",
            )
        for project in self.refused_projects.keys() - refused.keys():
            log.info("antenna_project_listed_again", project=project)
        self.refused_projects = refused

    async def _page(
        self, status: str, offset: int, project: int | None
    ) -> tuple[list[Job], bool] | None:
        params: dict[str, object] = {
            "pipeline__slug__in": ",".join(self._pipelines),
            "ids_only": 1,
            "incomplete_only": 1,
            "dispatch_mode": "async_api",
            "status": status,
            "ordering": "created_at",
            "limit": self._limit,
            "offset": offset,
            **project_params(project),
        }
        reply = await self._client.get("jobs/", "jobs", params)
        refused = project_refusal(project, reply)
        if refused is not None:
            self._answered()
            raise refused
        token = reply.status in (401, 403)
        self._token_refusal = f"listing jobs: {reply.why()}" if token else None
        if reply.status >= 500:  # a restart, or a proxy with nothing behind it
            self._failed(f"listing jobs: {reply.why()}")
        elif not reply.ok:
            self._answered()
        if not reply.ok or not isinstance(reply.body, dict):
            log.warning(
                "antenna_jobs_refused", reason=reply.why(), retry_in_s=self._next_listing_s()
            )
            return None
        results = reply.body.get("results")
        items = [job for item in results or [] if (job := self._job_of(item))]
        more = bool(results) and bool(reply.body.get("next"))
        return items, more

    def _job_of(self, item: Any) -> Job | None:
        if not (isinstance(item, dict) and isinstance(item.get("id"), int)):
            return None
        slug = item.get("pipeline_slug")
        slug = slug if isinstance(slug, str) else ""  # "": said by the job itself
        if slug and slug not in self._pipelines:  # Antenna filters by our slugs: never ours
            log.warning("antenna_job_not_ours", job_id=item["id"], pipeline=slug)
            return None
        return Job(item["id"], slug)

    def unread(self) -> dict[int, str]:
        """The listed jobs whose own page could not be read yet, and why (so none is served)."""
        return {job_id: unread.why for job_id, unread in self._unread.items()}

    def unread_for_s(self) -> float | None:
        """How long the longest-unread listed job's page has failed; None when none has."""
        if not self._unread:
            return None
        return time.monotonic() - min(u.since for u in self._unread.values())

    def _not_read(self, job_id: int, why: str) -> None:
        """The job's page could not be read: asked again after a poll interval, then twice as
        late each time, up to ``_FAILING_MAX_POLLS`` intervals (as a failing listing is)."""
        now, before = time.monotonic(), self._unread.get(job_id)
        wait_s = self._poll_interval_s if before is None else before.wait_s
        since = now if before is None else before.since
        longest_s = _FAILING_MAX_POLLS * self._poll_interval_s
        self._unread[job_id] = _Unread(why, since, now + wait_s, min(2 * wait_s, longest_s))
        log.warning(
            "antenna_job_unread",
            job_id=job_id,
            reason=why,
            retry_in_s=round(wait_s, 2),
            action="not served until its page names its pipeline",
        )

    async def _detail_slug(self, job_id: int) -> str | None:
        """The pipeline's slug on the job's own page ("" when it names none, or Antenna has no
        such job); None when the page could not be read (an error answer, or none)."""
        try:
            reply = await self._client.get(f"jobs/{job_id}/", "job")
        except AntennaUnreachable as error:
            self._not_read(job_id, str(error))
            return None
        if reply.status == 404:
            return ""
        if not (reply.ok and isinstance(reply.body, dict)):
            self._not_read(job_id, f"reading job {job_id}: {reply.why()}")
            return None
        self._unread.pop(job_id, None)
        pipeline = reply.body.get("pipeline")
        slug = reply.body.get("pipeline_slug") or (
            pipeline.get("slug") if isinstance(pipeline, dict) else None
        )
        return slug if isinstance(slug, str) else ""

    async def _ours(self, job: Job) -> Job | None:
        """``job`` with its pipeline, when it is one we serve. An Antenna whose jobs list
        leaves ``pipeline_slug`` out (its ids-only serializer gave ``id`` alone) names it in
        the job itself; a worker of one pipeline takes the job as its own (Antenna listed it
        for that slug) without asking, one of several asks once and, told nothing, leaves it.
        A page that could not be read is asked again after a backoff (``_not_read``)."""
        slug = job.pipeline
        if not slug and len(self._pipelines) == 1:
            slug = self._pipelines[0]
        if not slug and job.id not in self._slugs:
            unread = self._unread.get(job.id)
            if unread is not None and time.monotonic() < unread.next_at:
                return None  # asked again once its wait is over
            found = await self._detail_slug(job.id)
            if found is None:
                return None
            self._slugs[job.id] = found
        if not slug:
            slug = self._slugs[job.id]
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

    def reserved_from(self, job: Job) -> None:
        self._last = job.id
        self._empty_for_s.pop(job.id, None)

    def empty(self, job: Job) -> None:
        """``job`` gave nothing (done, paused, or reserved by others): skip it until the next
        poll, and twice as long each time it gives nothing again (up to ``_EMPTY_MAX_POLLS``
        polls)."""
        now = time.monotonic()
        until_poll = self._listed_at + self._poll_interval_s - now
        skip_s = self._empty_for_s.get(job.id, 0.0)
        self._empty_until[job.id] = now + max(until_poll, skip_s)
        longest_s = _EMPTY_MAX_POLLS * self._poll_interval_s
        self._empty_for_s[job.id] = min(max(2 * skip_s, self._poll_interval_s), longest_s)

    def any_ready(self) -> bool:
        return bool(self.next_jobs())
