"""The Antenna source's parts, built once from the settings (the counterpart of
``worker/nats/parts.py``): client, job rotation, reservations, the source, the poster, the
settler, their health and their shutdown. No NATS connection."""

from __future__ import annotations

import time
from typing import Any

from config.names import env_name
from config.settings import Settings
from pipelines.declare import Pipeline
from pipelines.models import Algorithm
from worker.antenna.catalog import Catalog
from worker.antenna.client import AntennaClient
from worker.antenna.identity import client_info
from worker.antenna.inactive import inactive_jobs
from worker.antenna.job_listing import JobRotation
from worker.antenna.post import Poster
from worker.antenna.registration import project_ids
from worker.antenna.render import AntennaPipeline
from worker.antenna.reservations import Reservation, Reservations
from worker.antenna.settle import AntennaSettler
from worker.antenna.source import AntennaSource
from worker.antenna.source_metrics import AntennaMetrics
from worker.antenna.waiting import antenna_waiting_read
from worker.core.link import SourceLink
from worker.core.ports import SourceHealth
from worker.engine.served import ServedPipelines
from worker.health.metrics import Metrics
from worker.health.tasks_waiting import TasksWaiting


class NoResultsLookup:
    """Antenna cannot be asked whether a task's result is saved: never, as far as we know
    (an identical repost is harmless there)."""

    async def exists(self, job_id: str, task_id: str) -> bool:
        return False


def reservation_size(s: Settings) -> int:
    return s.antenna.reservation_size or s.loader.batch_size


def finish_within_s(s: Settings) -> float:
    return s.antenna.finish_within_s or s.antenna.ttr_s / 2


def pipeline_entry(pipeline: Pipeline, algorithms: list[Algorithm]) -> AntennaPipeline:
    return AntennaPipeline(
        pipeline.name, pipeline.description, tuple(algorithms), pipeline.title, pipeline.version
    )


class AntennaParts:
    """The parts for the served pipelines: their jobs are listed and reserved from, and
    results are checked against each one's entry (``Catalog``) as its models load. Each part
    counts into ``metrics`` (Antenna's own metrics are registered in its registry) from the
    start."""

    def __init__(
        self,
        s: Settings,
        served: ServedPipelines,
        pipelines: dict[str, Pipeline],
        metrics: Metrics,
    ) -> None:
        a = s.antenna
        self._settings = s
        self._served = served
        self._pipelines = pipelines
        self.catalog = Catalog(served.names)
        reservations = Reservations(
            a.ttr_s, finish_within_s(s), reservation_size(s), batch_size=s.loader.batch_size
        )
        counted = AntennaMetrics(
            metrics.registry, lambda: len(reservations), reservations.oldest_seconds_left
        )
        self.client = AntennaClient(
            a.base_url,
            a.token,
            a.request_timeout_s,
            count=counted.count_call,
            scheme=a.auth_scheme,
        )
        # Checked as a setting (config/cross_checks.py).
        projects = tuple(project_ids(a.project_ids))
        self.jobs = JobRotation(
            self.client, self.catalog.slugs, a.poll_interval_s, a.jobs_limit, projects
        )
        info = client_info(a.service_name, self.catalog.slugs, s.process_index)
        self.source = self._source(s, reservations, info)
        self.poster = Poster(
            self.client,
            a.max_post_bytes,
            a.post_timeout_s,
            retried=counted.posts_retried.inc,
            split=counted.posts_split.inc,
            client_info=info,
        )
        self.settler = AntennaSettler(self.poster, self.catalog, a.max_post_bytes)
        self.waiting = TasksWaiting(
            antenna_waiting_read(self.client, self.catalog.slugs, a.jobs_limit, projects),
            s.metrics.tasks_waiting_read_s,
        )
        metrics.registry.register(self.waiting)
        self.link = self._link(s)

    def _source(
        self, s: Settings, reservations: Reservations, info: dict[str, Any]
    ) -> AntennaSource:
        a = s.antenna
        return AntennaSource(
            self.client,
            self.jobs,
            reservations,
            reservation_size=reservation_size(s),
            wait_s=a.fetch_wait_s,
            max_deliver=a.max_deliver,
            idle_wait_s=a.idle_wait_s or a.ttr_s + self.jobs.longest_skip_s() + a.poll_interval_s,
            client_info=info,
            unreachable_wait_s=a.unreachable_wait_s,
            default_pipeline=self.catalog.default,
        )

    def _link(self, s: Settings) -> SourceLink[Reservation]:
        return SourceLink(
            kind="antenna",
            source=self.source,
            results=NoResultsLookup(),
            settler=self.settler,
            fetch_wait_s=s.antenna.fetch_wait_s,
            keepalive_tick_s=s.antenna.ttr_s / 4,
            unserved=self.unserved,
            given_up=self.given_up,
            finish_held_on_stop=True,  # a give-back costs the TTR and a delivery
            extends_leases=False,  # no call extends a reservation
            results_waiting=lambda: self.poster.waiting() > 0,
            helpers=(("tasks-waiting", self.waiting.run),),
            inactive_jobs=inactive_jobs(self.jobs, self.source.reservations),
        )

    async def open(self) -> None:
        """Nothing to connect: every call is its own (kept-alive) exchange."""

    def started(self) -> dict[str, Any]:
        return {"max_deliver": self._settings.antenna.max_deliver}

    async def loaded(self, pipeline: str) -> None:
        """Record the loaded pipeline's algorithm keys and category maps in the catalog."""
        runner = self._served.loaded(pipeline)
        if runner is not None:
            self.catalog.add(pipeline_entry(self._pipelines[pipeline], runner.algorithms()))

    def unserved(self) -> str | None:
        """Why no task could be asked for: the token or a project's listing refused now, or
        no listing of the jobs answered since the start (unreachable, or answering errors)."""
        refusal = self.source.refusal()
        if refusal:
            return f"Antenna refused: {refusal}"
        failing_s = self.jobs.failing_for_s()
        if failing_s is not None:
            return (
                f"Antenna at {self.client.shown()} found unavailable by every listing of its "
                f"jobs for {failing_s:.0f}s ({env_name('antenna', 'unreachable_wait_s')}="
                f"{self._settings.antenna.unreachable_wait_s:g}): {self.jobs.last_failure}"
            )
        if not self.jobs.ever_listed:
            return (
                f"Antenna at {self.client.shown()} never listed its jobs (unreachable or failing)"
            )
        return self._unread() or self.source.still_out()

    def given_up(self) -> str | None:
        """``run --until-idle`` with tasks held: why it ends now, every call to Antenna
        (listings, reservations, result posts) having failed for
        ``WORKER_ANTENNA__UNREACHABLE_WAIT_S``; the drain leaves the held tasks to Antenna's
        redelivery, each with its line. None while it need not (with none held, ``unserved``
        says why an idle run ends)."""
        since, held = self.client.unreachable_since, len(self.source.reservations)
        wait_s = self._settings.antenna.unreachable_wait_s
        if since is None or not held or time.monotonic() - since < wait_s:
            return None
        return (
            f"Antenna at {self.client.shown()} unavailable to every call for "
            f"{time.monotonic() - since:.0f}s ({env_name('antenna', 'unreachable_wait_s')}="
            f"{wait_s:g}) with {held} task(s) held, left to Antenna's redelivery: "
            f"{self.client.last_problem}"
        )

    def _unread(self) -> str | None:
        """Listed jobs left unserved because their own page (their pipeline) was never read."""
        unread = self.jobs.unread()
        if not unread:
            return None
        shown = "; ".join(f"job {job_id}: {why}" for job_id, why in list(unread.items())[:5])
        return (
            f"Antenna listed job(s) {', '.join(map(str, unread))} for this process's pipelines, "
            f"and their own page, which names their pipeline, could not be read for "
            f"{self.jobs.unread_for_s() or 0:.0f}s "
            f"({env_name('antenna', 'unreachable_wait_s')}="
            f"{self._settings.antenna.unreachable_wait_s:g}): not served: {shown}"
        )

    def health(self) -> SourceHealth:
        since = self.client.unreachable_since
        down_s = 0.0 if since is None else time.monotonic() - since
        return SourceHealth(since is None, down_s)

    def problem(self) -> str | None:
        """Why /readyz should answer 503: Antenna refusing our token or a project's listing
        (the other projects served meanwhile), or for longer than
        ``WORKER_HEALTH__DISCONNECTED_TIMEOUT_S`` unreachable, or answering every listing of
        its jobs with an error (a 500 too: its connection works, and no job is found)."""
        refusal = self.source.refusal()
        if refusal:
            return f"Antenna refused: {refusal}"
        unreachable_for_s = self._settings.health.disconnected_timeout_s
        since = self.client.unreachable_since
        if since is not None and time.monotonic() - since > unreachable_for_s:
            return (
                f"Antenna unreachable for {time.monotonic() - since:.0f}s at "
                f"{self.client.shown()}: {self.client.last_problem}"
            )
        failing_s = self.jobs.failing_for_s()
        if failing_s is not None and failing_s > unreachable_for_s:
            return (
                f"Antenna at {self.client.shown()} failed every listing of its jobs for "
                f"{failing_s:.0f}s: {self.jobs.last_failure}"
            )
        return None

    async def close(self) -> None:
        """The poster (what is finished gets its last chance), then the client."""
        await self.poster.close()
        self.client.close()
