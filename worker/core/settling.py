"""A verdict carried out, and a batch run settled.

``Settling``: a verdict handed to the source's settler, then counted
(``inference_worker_tasks_total{outcome}``) and, for a kept result, said in the one
``task_done`` line. The only way the core settles a task, so every path counts alike.

``BatchSettling``: what ``Batches`` hands each batch run to: every task's verdict decided
(``verdicts.decide``) and carried out at once, its store timed, the held tasks kept alive.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import structlog

from worker.core.claims import Claim, Claims
from worker.core.outcome import Outcome
from worker.core.ports import BatchReport, Delivered, Settler
from worker.core.results import Kept, ResultMaker, Settled
from worker.core.verdicts import Backoff, Verdict, decide, log_task_done
from worker.health.liveness import Liveness
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


class BatchSettling:
    def __init__(
        self,
        settling: Settling,
        claims: Claims,
        results: ResultMaker,
        backoff: Backoff,
        retry_in_s: Callable[[str], float],
        metrics: Metrics,
        liveness: Liveness,
        stop: asyncio.Event,
    ) -> None:
        self._settling = settling
        self._claims = claims
        self._results = results
        self._backoff = backoff
        self._retry_in_s = retry_in_s  # a pipeline's wait for its next load, while unavailable
        self._metrics = metrics
        self._liveness = liveness
        self._stop = stop  # set once the run stops: a settle then counts as the drain working
        self._batch_s: deque[float] = deque(maxlen=5)  # the last batches' load + infer + store

    def longest_recent_s(self, default_s: float) -> float:
        """The longest of the last five batches (load + infer + store), or ``default_s``."""
        return max(self._batch_s, default=default_s)

    async def settle(self, batch: list[Claim], report: BatchReport) -> None:
        """``Batches``'s ``SettleBatch``: each task acked with its result stored, or given
        back; cancelled (the drain's time ran out), what is not acked is given back at once."""
        self._claims.inferred(batch)  # their images are gone: the next batch may be fetched
        started = time.perf_counter()
        await asyncio.gather(*(self._settle_one(h, report.outcomes[h.key]) for h in batch))
        store_s = time.perf_counter() - started
        self._metrics.observe_stage("store", batch[0].task.pipeline, store_s)
        self._batch_s.append(report.load_s + report.infer_s + store_s)
        await self._claims.keep_alive()

    async def _settle_one(self, held: Claim, outcome: Outcome) -> None:
        total_s = time.monotonic() - held.fetched_at
        timings_s = {**outcome.timings_s, "total_s": total_s}
        timed = Outcome(outcome.detections, outcome.failure, timings_s)
        delivered = held.delivered
        try:
            verdict = decide(
                held.task,
                timed,
                delivered=delivered.delivered,
                deliveries_left=delivered.deliveries_left,
                results=self._results,
                backoff=self._backoff,
                not_before_s=self._retry_in_s(held.task.pipeline),
            )
            await self._settling.settle(delivered, verdict)
        except asyncio.CancelledError:  # the drain's time ran out: given back, never stranded
            why = "the drain ended before its result was stored"
            await self._claims.give_back_within([held], why)
            raise
        except Exception:  # the per-task boundary: logged; its ack wait brings it back
            log.exception("settle_failed", task_id=held.task.id, job_id=held.task.job_id)
        finally:
            self._claims.release([held])
            if self._stop.is_set():
                self._liveness.still_working()  # a drain that settles is working
