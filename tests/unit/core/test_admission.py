"""A delivered task's way in (``worker.core.admission.Admission``): what names no task is kept
aside, what cannot run gets its error result, what is done already is not run again, a task of
a pipeline that cannot load here is given back (or held, on its last delivery), and the rest are
held, to be loaded. No delivery ends the fetch loop."""

from __future__ import annotations

from typing import Any

import pytest

from config.errors import Failure, ResultsUnavailable
from worker.core.admission import Admission
from worker.core.claims import Claims
from worker.core.ports import Delivered
from worker.core.results import Kept, ResultMaker, Settled
from worker.core.tasks import Read, Task
from worker.core.verdicts import Backoff, Decision, Verdict
from worker.health.liveness import Liveness


class Settler:
    def __init__(self) -> None:
        self.verdicts: list[tuple[Any, Verdict]] = []

    async def settle(self, delivered: Delivered[Any], verdict: Verdict) -> Settled:
        self.verdicts.append((delivered.handle, verdict))
        return Settled(Kept.GIVEN_BACK)

    async def keep_alive(self, delivered: Delivered[Any]) -> None:
        return None


class Stored:
    def __init__(self, done: frozenset[str] = frozenset(), down: bool = False) -> None:
        self.done, self.down = done, down

    async def exists(self, job_id: str, task_id: str) -> bool:
        if self.down:
            raise ResultsUnavailable("the store does not answer")
        return task_id in self.done


def task(n: int, pipeline: str = "moths") -> Task:
    return Task(f"t{n}", "j1", f"img-{n}", f"s3://b/{n}.jpg", pipeline=pipeline)


def delivery(read: Read, handle: Any, left: int = 2) -> Delivered[Any]:
    return Delivered(read, delivered=1, deliveries_left=left, handle=handle)


def admission_of(
    settler: Settler, stored: Stored | None = None, unavailable: frozenset[str] = frozenset()
) -> tuple[Admission, Claims]:
    claims = Claims(10, Liveness(60.0), settler, parked=unavailable.__contains__, parked_max=1)
    admission = Admission(
        settler,
        stored or Stored(),
        claims,
        ResultMaker(worker={"host": "h", "pid": 1}),
        available=lambda pipeline: pipeline not in unavailable,
        backoff=Backoff(2.0, 60.0),
        holds_last=True,
        retry_in_s=lambda _pipeline: 30.0,
    )
    return admission, claims


async def test_a_task_is_held_and_what_names_none_or_cannot_run_is_settled_at_once():
    settler = Settler()
    admission, claims = admission_of(settler)
    bad = Failure("invalid_uri", "'image_url' must be an s3:// URI")
    held = await admission.admit(delivery(Read(task(1)), "ok"))
    assert await admission.admit(delivery(Read(None, unnamed_reason="not JSON"), "junk")) is None
    assert await admission.admit(delivery(Read(task(2), failure=bad), "bad")) is None
    assert held is not None and held.task == task(1) and len(claims) == 1
    (junk, unnamed), (bad_handle, kept) = settler.verdicts
    assert (junk, unnamed.decision, unnamed.reason) == ("junk", Decision.UNNAMED, "not JSON")
    assert bad_handle == "bad" and kept.decision is Decision.KEEP and kept.result is not None
    assert kept.result.failure == bad and kept.result.task == task(2)


@pytest.mark.parametrize("down", [False, True])
async def test_a_task_done_before_is_settled_without_running_unless_the_store_cannot_tell(
    down: bool,
):
    settler = Settler()
    admission, claims = admission_of(settler, Stored(frozenset({"t1"}), down=down))
    held = await admission.admit(delivery(Read(task(1)), "again"))
    if down:  # the store refuses a duplicate anyway: run it
        assert held is not None and settler.verdicts == []
    else:
        assert held is None and len(claims) == 0
        assert [v.decision for _, v in settler.verdicts] == [Decision.DONE_BEFORE]


async def test_a_task_of_an_unloadable_pipeline_is_given_back_until_its_next_load():
    settler = Settler()
    admission, claims = admission_of(settler, unavailable=frozenset({"broken"}))
    assert await admission.admit(delivery(Read(task(1, "broken")), "b1")) is None
    ((handle, verdict),) = settler.verdicts
    assert handle == "b1" and verdict.decision is Decision.GIVE_BACK
    assert verdict.delay_s == 30.0  # its next load, not the 2 s backoff
    assert "'broken' is unavailable on this host" in verdict.reason and len(claims) == 0


async def test_on_its_last_delivery_one_batch_is_held_for_the_load_and_the_next_given_back():
    settler = Settler()
    admission, claims = admission_of(settler, unavailable=frozenset({"broken"}))
    first = await admission.admit(delivery(Read(task(1, "broken")), "last1", left=0))
    second = await admission.admit(delivery(Read(task(2, "broken")), "last2", left=0))
    assert first is not None and second is None and len(claims) == 1
    ((handle, verdict),) = settler.verdicts
    assert handle == "last2" and verdict.decision is Decision.GIVE_BACK
    assert "held already" in verdict.reason


async def test_a_delivery_that_cannot_be_admitted_is_given_back_not_the_end_of_fetching():
    settler = Settler()
    admission, _ = admission_of(settler)
    broken = delivery(Read(task(1)), "odd")
    object.__setattr__(broken, "read", None)  # what no source sends: admission raises
    assert await admission.admit(broken) is None
    ((handle, verdict),) = settler.verdicts
    assert handle == "odd" and verdict.decision is Decision.GIVE_BACK
    assert verdict.reason == "it could not be admitted"
