"""Held tasks (``worker.core.claims``): a long batch that advances keeps its tasks' ack waits
extended, one that stopped advancing does not; held tasks of unavailable pipelines take no room
up to their cap."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from worker.core.claims import Claims, keep_alive_while_advancing
from worker.health.liveness import Liveness


def task(pipeline: str) -> Any:
    return SimpleNamespace(pipeline=pipeline, id="t", job_id="j")


class KeptAlive:
    def __init__(self) -> None:
        self.count = 0

    async def keep_alive(self, delivered: Any) -> None:
        self.count += 1


async def extended(advancing: bool, busy: bool = True) -> int:
    """How many times one held task's ack wait was extended over about five ticks of a batch
    whose forward passes end (``advancing``) or do not."""
    settler = KeptAlive()
    claims = Claims(4, Liveness(60.0), settler)  # type: ignore[arg-type]
    claims.add(SimpleNamespace(), task("moths"))
    clock = iter(range(1000))
    progress = [0.0]
    stop = asyncio.Event()

    def last_progress() -> float:
        if advancing:
            progress[0] = float(next(clock))  # a pass ended since the last look
        return progress[0]

    keeper = asyncio.create_task(
        keep_alive_while_advancing(claims, last_progress, lambda: busy, stop, 0.02)
    )
    await asyncio.sleep(0.11)
    stop.set()
    await asyncio.wait_for(keeper, 5)
    return settler.count


async def test_a_batch_that_advances_keeps_its_tasks_alive_while_it_runs():
    assert await extended(advancing=True) >= 2


async def test_a_batch_that_stopped_advancing_or_no_batch_keeps_nothing_alive():
    assert await extended(advancing=False) == 0
    assert await extended(advancing=True, busy=False) == 0


def test_tasks_held_for_an_unavailable_pipeline_take_no_room_up_to_their_cap():
    unavailable = {"broken"}
    claims = Claims(4, Liveness(60.0), settler=None, parked=unavailable.__contains__, parked_max=2)
    for _ in range(4):
        claims.add(SimpleNamespace(), task("broken"))
    # Four held for "broken": two of them outside the room, two in it.
    assert claims.room() == 2 and claims.parked_full()
    unavailable.clear()  # it loads again: they run, and count as any held task
    assert claims.room() == 0 and not claims.parked_full()
