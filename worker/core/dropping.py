"""Held tasks of a job its source no longer shows as active, dropped before they run.

A job cancelled at its source (Antenna answers ``{"tasks": []}`` for a job that is not
active, and ignores results posted late) leaves what this process already reserved of it
waiting for the engine: GPU time for results nobody reads. Before each fetch the source is
asked which of its jobs are no longer active (``SourceLink.inactive_jobs``), also while the
cap is full and nothing is fetched; their tasks
still waiting for a batch are taken out of the batches to come, handed back to the source
(its give-back: Antenna posts nothing), released, and each said in a
``task_dropped_job_inactive`` line and counted (``inference_worker_tasks_dropped_total``).
A batch already on the engine runs to its end.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import structlog

from worker.core.batches import Batches
from worker.core.claims import Claims
from worker.health.metrics import Metrics

log = structlog.get_logger(__name__)
REASON = "job_inactive"


class InactiveJobDrops:
    def __init__(
        self,
        inactive_jobs: Callable[[], Awaitable[frozenset[str]]],
        batches: Batches,
        claims: Claims,
        metrics: Metrics,
    ) -> None:
        self._inactive_jobs = inactive_jobs
        self._batches = batches
        self._claims = claims
        self._metrics = metrics

    async def drop(self) -> None:
        """The waiting tasks of every job the source no longer shows as active, dropped."""
        gone = await self._inactive_jobs()
        if not gone:
            return
        dropped = self._batches.take_jobs(gone)
        for held in dropped:
            log.info(
                "task_dropped_job_inactive",
                task_id=held.task.id,
                job_id=held.task.job_id,
                image_id=held.task.image_id,
                pipeline=held.task.pipeline,
                hint="its job is no longer active at the source: nothing is run or posted",
            )
            self._metrics.tasks_dropped.labels(REASON).inc()
        await self._claims.give_back(dropped, "its job is no longer active")
