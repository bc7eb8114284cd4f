"""What becomes of a delivered task (``worker.core.verdicts.decide``): kept, left for another
delivery after the backoff, kept as an error once the deliveries run out, or given back when its
pipeline cannot be loaded here; and the one ``task_done`` line a kept result logs."""

from __future__ import annotations

from typing import Any

import pytest

from config.errors import Failure
from worker.core.outcome import Outcome
from worker.core.results import Kept, ResultMaker, Settled
from worker.core.tasks import Task
from worker.core.verdicts import NO_BACKOFF, Backoff, Decision, decide, log_task_done

TASK = Task("t1", "j1", "img-1", "s3://bucket/img-1.jpg", pipeline="moths")
S3_DOWN = Failure("s3_unavailable", "S3 answered 503", retryable=True)
MISSING = Failure("object_missing", "no such key")
UNLOADABLE = Failure("model_load_failed", "the file host answered 403", retryable=True)


def decided(outcome: Outcome, delivered: int = 1, left: int = 2, **kw: Any) -> Any:
    return decide(
        TASK,
        outcome,
        delivered=delivered,
        deliveries_left=left,
        results=ResultMaker(worker={"host": "h", "pid": 1}),
        backoff=kw.pop("backoff", NO_BACKOFF),
        **kw,
    )


def test_an_ok_outcome_is_kept_with_its_detections_and_attempt():
    verdict = decided(Outcome(detections=[]), delivered=2)
    assert verdict.decision is Decision.KEEP and verdict.result is not None
    assert verdict.result.failure is None and verdict.result.attempt == 2
    assert verdict.result.task is TASK and not verdict.result.ran_out


def test_a_transient_failure_waits_the_doubled_backoff_while_deliveries_are_left():
    backoff = Backoff(base_s=5.0, max_s=30.0)
    waits = [decided(Outcome(failure=S3_DOWN), delivered=n, backoff=backoff) for n in (1, 2, 3, 9)]
    assert {v.decision for v in waits} == {Decision.RETRY}
    assert [v.delay_s for v in waits] == [5.0, 10.0, 20.0, 30.0]  # doubled, then the cap
    assert waits[0].reason == "S3 answered 503" and waits[0].result is None


def test_a_transient_failure_on_the_last_delivery_is_kept_saying_the_deliveries_ran_out():
    verdict = decided(Outcome(failure=S3_DOWN), delivered=3, left=0)
    assert verdict.decision is Decision.KEEP and verdict.result is not None
    assert verdict.result.failure == S3_DOWN and verdict.result.ran_out


def test_a_permanent_failure_is_kept_at_once_with_deliveries_left():
    verdict = decided(Outcome(failure=MISSING), left=5)
    assert verdict.decision is Decision.KEEP and verdict.result is not None
    assert verdict.result.failure == MISSING and not verdict.result.ran_out


@pytest.mark.parametrize("left", [2, 0])
def test_a_pipeline_that_cannot_load_gives_its_task_back_never_an_error(left: int):
    verdict = decided(
        Outcome(failure=UNLOADABLE), left=left, backoff=Backoff(1.0, 60.0), not_before_s=12.0
    )
    assert verdict.decision is Decision.GIVE_BACK and verdict.result is None
    assert verdict.delay_s == 12.0  # until its next load: longer than the backoff's 1 s
    assert verdict.reason == "the file host answered 403"


class Bound:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.lines.append(("info", event, fields))

    def warning(self, event: str, **fields: Any) -> None:
        self.lines.append(("warning", event, fields))


def test_task_done_is_info_with_detections_when_ok_and_a_warning_naming_the_error_else():
    bound = Bound()
    log_task_done(bound, Settled(Kept.OK, detections=3), {"infer_s": 0.5})
    log_task_done(bound, Settled(Kept.ERROR, error_type="object_missing", error="no such key"), {})
    assert bound.lines == [
        ("info", "task_done", {"status": "ok", "infer_s": 0.5, "detections": 3}),
        (
            "warning",
            "task_done",
            {"status": "error", "error_type": "object_missing", "error": "no such key"},
        ),
    ]
