"""A verdict carried out: handed to the source's settler, then counted
(``inference_worker_tasks_total{outcome}``) and, for a kept result, said in the one
``task_done`` line. The only way the core settles a task, so every path counts alike."""

from __future__ import annotations

from typing import Any

import structlog

from worker.core.ports import Delivered, Settler
from worker.core.results import Kept, Settled
from worker.core.verdicts import Verdict, log_task_done
from worker.health.metrics import Metrics

log = structlog.get_logger(__name__)


class Settling:
    def __init__(self, settler: Settler[Any], metrics: Metrics) -> None:
        self._settler = settler
        self._metrics = metrics

    async def settle(self, delivered: Delivered[Any], verdict: Verdict) -> Settled:
        settled = await self._settler.settle(delivered, verdict)
        if settled.kept.counted:
            self._metrics.tasks.labels(settled.kept.value).inc()
        if settled.kept in (Kept.OK, Kept.ERROR):
            _say_done(delivered, verdict, settled)
        return settled

    async def keep_alive(self, delivered: Delivered[Any]) -> None:
        await self._settler.keep_alive(delivered)


def _say_done(delivered: Delivered[Any], verdict: Verdict, settled: Settled) -> None:
    """The ``task_done`` line of a task whose result was kept: named by its result's task, or,
    for one that names none (its source still kept an error result), by its delivery."""
    result = verdict.result
    if result is None:
        bound = log.bind(**delivered.log_fields, attempt=delivered.delivered)
        log_task_done(bound, settled, {})
        return
    task = result.task
    bound = log.bind(
        task_id=task.id, job_id=task.job_id, image_id=task.image_id, attempt=result.attempt
    )
    log_task_done(bound, settled, {name: round(s, 6) for name, s in result.timings_s.items()})
