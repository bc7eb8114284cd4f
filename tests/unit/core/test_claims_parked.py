"""Held tasks of unavailable pipelines (on their last delivery, waiting for a load) take no
fetch room up to one batch: else they would fill it and the host would serve no pipeline."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from worker.core.claims import Claims
from worker.health.liveness import Liveness


def task(pipeline: str) -> Any:
    return SimpleNamespace(pipeline=pipeline, id="t", job_id="j")


def test_tasks_held_for_an_unavailable_pipeline_take_no_room_up_to_their_cap():
    unavailable = {"broken"}
    claims = Claims(4, Liveness(60.0), settler=None, parked=unavailable.__contains__, parked_max=2)
    for _ in range(4):
        claims.add(SimpleNamespace(), task("broken"))
    # Four held for "broken": two of them outside the room, two in it.
    assert claims.room() == 2 and claims.parked_full()
    unavailable.clear()  # it loads again: they run, and count as any held task
    assert claims.room() == 0 and not claims.parked_full()
