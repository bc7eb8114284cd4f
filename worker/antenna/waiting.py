"""Tasks waiting per pipeline on Antenna, for ``inference_worker_tasks_waiting``
(``worker.health.tasks_waiting`` reads it every ``WORKER_METRICS__TASKS_WAITING_READ_S``).

Antenna's ids-only listing, the one the rotation polls (``worker.antenna.job_listing``), gives a
job's ``id`` and ``pipeline_slug`` and nothing more. Its full listing (``JobListSerializer``, the
same ``GET jobs/`` without ``ids_only``) gives each job's ``pipeline`` (with its ``slug``) and
its ``progress`` (``JobProgress``): stages by key, each with its params by key. For an
``async_api`` job Antenna writes, at each result it processes, the ``process`` stage's
``remaining`` (its source images not yet processed: reserved ones included, so it counts what
is held as well as what waits), and before the first result the ``collect`` stage holds
``total_images`` (and ``limit`` when the job was limited). So: per pipeline, the sum over its
active jobs (STARTED, RETRY, each once: Antenna lists them twice for a token that is not a
superuser's) of ``remaining``, else of the collected images while the ``process`` stage has
not started. A pipeline with an active job that says neither is left out (not known); one
with no active job reads 0.

With ``WORKER_ANTENNA__PROJECT_IDS`` only those projects' jobs are counted, listed per project
as the rotation lists them (``jobs.project_params``); a project whose listing is refused
(``jobs.project_refusal``: the rotation reports it) is left out, and the others counted.

Cost: one listing per status (and project) and per 100 jobs (``WORKER_ANTENNA__JOBS_LIMIT``)
at each read.
"""

from __future__ import annotations

from typing import Any

from worker.antenna.client import AntennaClient, AntennaUnreachable
from worker.antenna.job_listing import ACTIVE, project_params, project_refusal
from worker.health.tasks_waiting import WaitingRead

_MAX_PAGES = 10  # per status: 1,000 jobs at the default page of 100


def _params(stage: Any) -> dict[str, Any]:
    params = stage.get("params") if isinstance(stage, dict) else None
    return {
        p["key"]: p.get("value")
        for p in params or []
        if isinstance(p, dict) and isinstance(p.get("key"), str)
    }


def _count(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        return None
    return int(value)


def job_remaining(job: dict[str, Any]) -> int | None:
    """The images a listed job has still to be processed, where its progress says; else None."""
    progress = job.get("progress")
    stages = progress.get("stages") if isinstance(progress, dict) else None
    if not isinstance(stages, list):
        return None
    by_key = {s.get("key"): s for s in stages if isinstance(s, dict)}
    process = by_key.get("process")
    remaining = _count(_params(process).get("remaining"))
    if remaining is not None:
        return remaining
    done = process.get("progress") if isinstance(process, dict) else None
    started = isinstance(done, int | float) and done > 0
    collect = _params(by_key.get("collect"))
    total = _count(collect.get("limit")) or _count(collect.get("total_images"))
    return None if started else total


def job_slug(job: dict[str, Any]) -> str | None:
    pipeline = job.get("pipeline")
    slug = job.get("pipeline_slug") or (
        pipeline.get("slug") if isinstance(pipeline, dict) else None
    )
    return slug if isinstance(slug, str) else None


def waiting_by_pipeline(jobs: list[dict[str, Any]], pipelines: tuple[str, ...]) -> dict[str, int]:
    counts = dict.fromkeys(pipelines, 0)
    unknown: set[str] = set()
    for job in jobs:
        slug = job_slug(job)
        if slug not in counts:
            continue
        remaining = job_remaining(job)
        if remaining is None:
            unknown.add(slug)
        else:
            counts[slug] += remaining
    return {p: n for p, n in counts.items() if p not in unknown}


def antenna_waiting_read(
    client: AntennaClient, pipelines: tuple[str, ...], limit: int, projects: tuple[int, ...] = ()
) -> WaitingRead:
    """The read ``worker.health.tasks_waiting.TasksWaiting`` makes: the active async jobs of
    ``pipelines``, every page, of each project that does not refuse its listing; any other
    refused or unreadable page fails the read."""

    async def listed(project: int | None) -> list[dict[str, Any]]:
        jobs: list[dict[str, Any]] = []
        for status in ACTIVE:
            for page in range(_MAX_PAGES):
                params: dict[str, object] = {
                    "pipeline__slug__in": ",".join(pipelines),
                    "incomplete_only": 1,
                    "dispatch_mode": "async_api",
                    "status": status,
                    "ordering": "created_at",
                    "limit": limit,
                    "offset": page * limit,
                    **project_params(project),
                }
                reply = await client.get("jobs/", "jobs", params)
                if project_refusal(project, reply) is not None:
                    return []  # the rotation names the project
                if not reply.ok or not isinstance(reply.body, dict):
                    raise AntennaUnreachable(f"listing jobs: {reply.why()}")
                results = reply.body.get("results") or []
                jobs += [j for j in results if isinstance(j, dict) and isinstance(j.get("id"), int)]
                if not (results and reply.body.get("next")):
                    break
        return jobs

    async def read() -> dict[str, int]:
        found: dict[int, dict[str, Any]] = {}
        for project in projects or (None,):
            for job in await listed(project):
                found.setdefault(job["id"], job)
        return waiting_by_pipeline(list(found.values()), pipelines)

    return read
