"""What a task ends with, typed: the ``Result`` the core hands a source to keep, and what the
source says it did (``Settled``). Each source renders a ``Result`` into its own wire format
(``worker.nats.render``: the stored result document; ``worker.antenna.render``: Antenna's
result post); nothing here knows either format: the detections are typed
(``pipelines.found``).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from config.errors import Failure
from pipelines.found import Detection
from worker.core.outcome import Outcome
from worker.core.tasks import Task


@dataclass(frozen=True)
class Result:
    """A task's end: its detections (``failure`` None) or the failure that stopped it, which
    pipeline's ``model`` made it, its stage timings, this worker, and the delivery (``attempt``,
    the source's count) that made it."""

    task: Task
    detections: list[Detection] | None
    failure: Failure | None
    model: dict[str, Any]
    timings_s: dict[str, float]
    worker: dict[str, Any]
    attempt: int
    # A transient failure on the source's last delivery: the task ran out of deliveries.
    ran_out: bool = False

    @property
    def ok(self) -> bool:
        return self.failure is None

    def final_failure(self) -> Failure | None:
        """The failure as a result says it: one that ran out of deliveries says so, and what
        the last delivery died of (its message, else its kind)."""
        failure = self.failure
        if failure is None or not self.ran_out:
            return failure
        return replace(failure, message=ran_out(self.attempt, failure.message or failure.kind))

    def total_s(self) -> float:
        """Seconds the task took, to 6 decimals: from fetch to result (``total_s``), else the
        stages' sum."""
        stages_s = self.timings_s.get("load_s", 0.0) + self.timings_s.get("infer_s", 0.0)
        return round(self.timings_s.get("total_s", stages_s), 6)


def ran_out(delivered: int, last_error: str) -> str:
    """What a transient failure on a task's last delivery says."""
    return f"deliveries ran out after {delivered} attempts; last error: {last_error}"


def worker_identity() -> dict[str, Any]:
    """Who made a result: this host and process (the result's ``worker``)."""
    return {"host": socket.gethostname(), "pid": os.getpid()}


@dataclass
class ResultMaker:
    """The ``Result`` a task ends with: its pipeline's ``model`` (``model_of``) and this
    worker's identity."""

    model_of: Callable[[str], dict[str, Any]] = lambda _pipeline: {}
    worker: dict[str, Any] = field(default_factory=worker_identity)

    def make(self, task: Task, attempt: int, outcome: Outcome, *, ran_out: bool = False) -> Result:
        return Result(
            task=task,
            detections=outcome.detections,
            failure=outcome.failure,
            model=self.model_of(task.pipeline),
            timings_s=outcome.timings_s,
            worker=self.worker,
            attempt=attempt,
            ran_out=ran_out and outcome.retryable,
        )


class Kept(Enum):
    """What a source did with a task (the ``inference_worker_tasks_total`` outcome; a task left
    for another delivery counts as ``retried``, one already done or given back not at all)."""

    OK = "ok"  # its ok result kept
    ERROR = "error"  # an error result kept (the one asked for, or one the source made instead)
    RETRIED = "retried"  # left for another delivery
    DEAD_LETTERED = "dead_lettered"  # kept aside with the reason: no result fits or names it
    DONE_BEFORE = "done_before"  # its result was kept before: settled without another
    GIVEN_BACK = "given_back"  # handed back to be delivered again at once

    @property
    def counted(self) -> bool:
        return self not in (Kept.DONE_BEFORE, Kept.GIVEN_BACK)


@dataclass(frozen=True)
class Settled:
    """What a source did (``kept``), and what the ``task_done`` line says of it: the detections
    kept, or why it ended in an error."""

    kept: Kept
    detections: int = 0
    error_type: str | None = None
    error: str | None = None
    # The task a result was kept for when the verdict carried none (a task that names none,
    # which its source still answered with an error result).
    task: Task | None = None
