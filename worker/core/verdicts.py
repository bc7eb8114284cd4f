"""The rules every task source shares, once: what a delivery's bytes make, retry or give up
given the deliveries left, what a final failure says, who this worker is, and the one
``task_done`` line. Each source's delivery rules (``worker/nats/settle.py``,
``worker/antenna/settle.py``) keep only what is its own: how a result is kept and a delivery
settled there.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from config.errors import Failure, InvalidTask, Undeliverable
from worker.core.outcome import Outcome
from worker.core.ports import Delivery
from worker.core.tasks import Task, invalid_task, make_result, parse_task


@dataclass(frozen=True)
class Read:
    """What a delivery's bytes make: a task, a task that cannot be run (``failure``: it gets an
    error result), or nothing that names a job and a task (``task`` None: a dead letter)."""

    task: Task | None
    failure: Failure | None = None
    dead_letter_reason: str = ""


def read_task(data: bytes, pipeline: str, job_id: str | None, default_pipeline: str) -> Read:
    """What a task's bytes make, for the pipeline and job its source names (``Delivery``):
    the pipeline, when the source names none, is ``default_pipeline`` (the one place an
    unnamed pipeline becomes the default)."""
    pipeline = pipeline or default_pipeline
    try:
        return Read(parse_task(data, pipeline=pipeline, job_id=job_id))
    except Undeliverable as error:
        return Read(None, dead_letter_reason=str(error))
    except InvalidTask as error:
        return Read(invalid_task(error, pipeline), error.failure())


def retries(outcome: Outcome, delivery: Delivery) -> bool:
    """A transient failure is left to the source to deliver again, while it will."""
    return outcome.retryable and delivery.deliveries_left > 0


def ran_out(delivered: int, last_error: str) -> str:
    """What a transient failure on a task's last delivery says."""
    return f"deliveries ran out after {delivered} attempts; last error: {last_error}"


def final(outcome: Outcome, delivered: int) -> Outcome:
    """The outcome a task ends with: a transient failure on its last delivery says the
    deliveries ran out, and what the last one died of (its message, else its kind)."""
    failure = outcome.failure
    if failure is None or not failure.retryable:
        return outcome
    message = ran_out(delivered, failure.message or failure.kind)
    return replace(outcome, failure=replace(failure, message=message))


def worker_identity() -> dict[str, Any]:
    """Who made a result: this host and process (the result's ``worker``)."""
    return {"host": socket.gethostname(), "pid": os.getpid()}


def log_task_done(
    bound: Any,
    status: str,
    timings_s: dict[str, float],
    *,
    detections: int = 0,
    error_type: str | None = None,
    error: str | None = None,
) -> None:
    """The one line per completed task (docs/metrics.md, "Logs"): its status and stage timings, and
    its detection count, or its error's type and scrubbed message. INFO when ok, WARNING when
    not."""
    if status == "ok":
        bound.info("task_done", status=status, **timings_s, detections=detections)
        return
    bound.warning("task_done", status=status, **timings_s, error_type=error_type, error=error)


@dataclass
class ResultMaker:
    """The result document a task ends with (``schemas.make_result``): its pipeline's
    ``model`` (``model_of``) and this worker's identity."""

    model_of: Callable[[str], dict[str, Any]] = lambda _pipeline: {}
    worker: dict[str, Any] = field(default_factory=worker_identity)

    def make(self, task: Task, attempt: int, outcome: Outcome) -> dict[str, Any]:
        return make_result(
            task=task,
            pipeline=task.pipeline,
            detections=outcome.detections,
            error=outcome.failure.as_dict() if outcome.failure is not None else None,
            model=self.model_of(task.pipeline),
            timings_s=outcome.timings_s,
            worker=self.worker,
            attempt=attempt,
        )
