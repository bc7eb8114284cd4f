"""What becomes of a delivered task, decided once for every source: a typed ``Verdict``.

The core decides; each source's settler (``worker/nats/settle.py``, ``worker/antenna/settle.py``)
only turns the verdict into its own wire actions (NATS: store then ack, nak after the delay,
dead-letter; Antenna: post, or leave to its redelivery) and says what it did (``Settled``).
A transient failure is left for another delivery while the source will make one; on the last
it becomes a final error result that says the deliveries ran out and what the last one died of.
A pipeline whose models cannot be loaded is the host's trouble, never the task's: its tasks are
given back (after the retry backoff's delay), never kept as an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from config.errors import UNAVAILABLE_KINDS
from worker.core.outcome import Outcome
from worker.core.results import Kept, Result, ResultMaker, Settled
from worker.core.tasks import Task


class Decision(Enum):
    KEEP = "keep"  # keep the result (ok, or a final error), then the task is done
    RETRY = "retry"  # leave it for another delivery, after ``delay_s``
    DONE_BEFORE = "done_before"  # its result is kept already: done, nothing kept again
    GIVE_BACK = "give_back"  # not finished here: for another delivery as soon as the source can
    UNNAMED = "unnamed"  # names no job and task: kept aside with the reason (dead letter)


@dataclass(frozen=True)
class Verdict:
    decision: Decision
    result: Result | None = None  # KEEP: what to keep
    delay_s: float = 0.0  # RETRY, GIVE_BACK: after how long it may come back (0: at once)
    reason: str = ""  # RETRY, GIVE_BACK, UNNAMED: why

    @classmethod
    def keep(cls, result: Result) -> Verdict:
        return cls(Decision.KEEP, result)


@dataclass(frozen=True)
class Backoff:
    """How long a task left for another delivery waits before it comes back: ``base_s``
    doubled per delivery, ``max_s`` at most (0: at once, or when the source decides)."""

    base_s: float = 0.0
    max_s: float = 0.0

    def delay_s(self, delivered: int) -> float:
        return float(min(self.max_s, self.base_s * (2 ** max(0, delivered - 1))))


NO_BACKOFF = Backoff()


def decide(
    task: Task,
    outcome: Outcome,
    *,
    delivered: int,
    deliveries_left: int,
    results: ResultMaker,
    backoff: Backoff,
    not_before_s: float = 0.0,
) -> Verdict:
    """A transient failure is left for another delivery while the source will make one; any
    other outcome is kept, a transient failure on the last delivery saying it ran out. A task
    whose pipeline could not be loaded is given back, after the backoff's delay or
    ``not_before_s`` (until its next load), the longer."""
    failure = outcome.failure
    if failure is not None and failure.kind in UNAVAILABLE_KINDS:
        delay_s = max(backoff.delay_s(delivered), not_before_s)
        return Verdict(Decision.GIVE_BACK, delay_s=delay_s, reason=failure.message)
    if outcome.retryable and deliveries_left > 0:
        why = outcome.failure.message if outcome.failure is not None else ""
        return Verdict(Decision.RETRY, delay_s=backoff.delay_s(delivered), reason=why)
    return Verdict.keep(results.make(task, delivered, outcome, ran_out=outcome.retryable))


def log_task_done(bound: Any, settled: Settled, timings_s: dict[str, float]) -> None:
    """The one line per task whose result was kept (docs/metrics.md, "Logs"): its status and
    stage timings, and its detection count, or its error's type and scrubbed message. INFO
    when ok, WARNING when not."""
    status = settled.kept.value
    if settled.kept is Kept.OK:
        bound.info("task_done", status=status, **timings_s, detections=settled.detections)
        return
    bound.warning(
        "task_done",
        status=status,
        **timings_s,
        error_type=settled.error_type,
        error=settled.error,
    )
