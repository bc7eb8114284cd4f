"""A verdict carried out: handed to the source's settler, then counted
(``inference_worker_tasks_total{outcome}``) and, for a kept result, said in the one
``task_done`` line. The only way the core settles a task, so every path counts alike."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import structlog

from worker.core.ports import Delivered, Settler
from worker.core.results import Kept, Settled
from worker.core.verdicts import Verdict, log_task_done
from worker.health.metrics import Metrics

log = structlog.get_logger(__name__)


class Settling:
    def __init__(self, settler: Settler[Any], metrics: Metrics, source: str) -> None:
        self._settler = settler
        self._metrics = metrics
        self._source = source  # "nats" or "antenna": said in each task_done line

    async def settle(self, delivered: Delivered[Any], verdict: Verdict) -> Settled:
        settled = await self._settler.settle(delivered, verdict)
        if settled.kept.counted:
            task = delivered.read.task
            self._metrics.count_task(settled.kept.value, task.pipeline if task else "")
        if settled.kept in (Kept.OK, Kept.ERROR):
            _say_done(log.bind(source=self._source), delivered, verdict, settled)
        return settled

    async def keep_alive(self, delivered: Delivered[Any]) -> None:
        await self._settler.keep_alive(delivered)


def _say_done(bound: Any, delivered: Delivered[Any], verdict: Verdict, settled: Settled) -> None:
    """The ``task_done`` line of a task whose result was kept, named by the task the result
    was kept for: the verdict's, or the one its source made up for a task that names none
    (``Settled.task``)."""
    result = verdict.result
    task = result.task if result is not None else settled.task
    attempt = result.attempt if result is not None else delivered.delivered
    timings_s = result.timings_s if result is not None else {}
    if settled.error_type is None and result is not None and result.failure is not None:
        settled = replace(settled, error_type=result.failure.kind)  # a settler that said none
    if task is not None:
        bound = bound.bind(task_id=task.id, job_id=task.job_id, image_id=task.image_id)
    else:
        bound = bound.bind(**delivered.log_fields)
    log_task_done(
        bound.bind(attempt=attempt), settled, {name: round(s, 6) for name, s in timings_s.items()}
    )
