"""The Antenna source's parts, built once from the settings: client, job rotation,
reservations, the source, the poster and the delivery rules."""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from config.settings import Settings
from pipelines.declare import Pipeline
from pipelines.models import Algorithm
from worker.antenna.catalog import Catalog
from worker.antenna.client import AntennaClient
from worker.antenna.jobs import JobRotation
from worker.antenna.metrics import AntennaMetrics
from worker.antenna.post import Poster
from worker.antenna.reservations import Reservations
from worker.antenna.results import Served
from worker.antenna.settle import AntennaRules
from worker.antenna.source import AntennaSource


class NoResultsLookup:
    """Antenna cannot be asked whether a task's result is saved: never, as far as we know
    (an identical repost is harmless there)."""

    async def exists(self, job_id: str, task_id: str) -> bool:
        return False


def reservation_size(s: Settings) -> int:
    return s.antenna.reservation_size or s.loader.batch_size


def finish_within_s(s: Settings) -> float:
    return s.antenna.finish_within_s or s.antenna.ttr_s / 2


def served(pipeline: Pipeline, algorithms: list[Algorithm]) -> Served:
    return Served(pipeline.name, pipeline.description, tuple(algorithms))


@dataclass
class AntennaParts:
    client: AntennaClient
    jobs: JobRotation
    source: AntennaSource
    poster: Poster
    rules: AntennaRules
    lookup: NoResultsLookup

    @classmethod
    def build(cls, s: Settings, catalog: Catalog) -> AntennaParts:
        """The parts for the pipelines of ``catalog``: their jobs are listed and reserved
        from, and results are checked against each one's entry as its models load."""
        a = s.antenna
        client = AntennaClient(a.base_url, a.token, a.request_timeout_s)
        jobs = JobRotation(client, catalog.slugs, a.poll_interval_s, a.jobs_limit)
        reservations = Reservations(a.ttr_s, finish_within_s(s), reservation_size(s))
        source = AntennaSource(
            client,
            jobs,
            reservations,
            reservation_size=reservation_size(s),
            wait_s=s.nats.fetch_timeout_s,
            max_deliver=a.max_deliver,
            idle_wait_s=a.idle_wait_s or a.ttr_s + jobs.longest_skip_s() + a.poll_interval_s,
        )
        poster = Poster(client, a.max_post_bytes, a.post_timeout_s)
        rules = AntennaRules(poster, catalog, a.max_deliver, a.max_post_bytes)
        return cls(client, jobs, source, poster, rules, NoResultsLookup())

    def attach(self, registry: CollectorRegistry) -> AntennaMetrics:
        reservations = self.source.reservations
        metrics = AntennaMetrics(
            registry, lambda: len(reservations), reservations.oldest_seconds_left
        )
        self.client.count = metrics.count_call
        self.poster.on_retry = metrics.posts_retried.inc
        self.poster.on_split = metrics.posts_split.inc
        return metrics

    def unserved(self) -> str | None:
        """Why no task could be asked for: the token refused now, or no listing of the jobs
        answered since the start (unreachable, or answering errors)."""
        refusal = self.source.refusal()
        if refusal:
            return f"Antenna refused: {refusal}"
        if not self.jobs.ever_listed:
            return (
                f"Antenna at {self.client.shown()} never listed its jobs (unreachable or failing)"
            )
        return self.source.still_out()

    def problem(self, unreachable_for_s: float) -> str | None:
        """Why /healthz should answer 503: Antenna refusing our token, or unreachable for
        longer than ``unreachable_for_s``."""
        refusal = self.source.refusal()
        if refusal:
            return f"Antenna refused: {refusal}"
        since = self.client.unreachable_since
        if since is not None and time.monotonic() - since > unreachable_for_s:
            return (
                f"Antenna unreachable for {time.monotonic() - since:.0f}s at "
                f"{self.client.shown()}: {self.client.last_problem}"
            )
        return None
