"""Pipelines unavailable on this host: the retry schedule, what is said, and the loads tried
again in the background until one succeeds."""

from __future__ import annotations

import asyncio

from config.errors import Failure
from worker.core.availability import Availability, retry_loads

REFUSED = Failure("model_load_failed", "GET https://host/m.pt: 403", reason="download_refused")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_lost_pipeline_is_retried_after_the_first_wait_then_twice_as_long_up_to_the_cap():
    clock = Clock()
    availability = Availability(first_s=30.0, max_s=100.0, clock=clock)
    changes: list[str] = []
    availability.watch(lambda: changes.append("changed"))

    availability.lost("moths", REFUSED)
    availability.lost("moths", REFUSED)  # said once: the schedule stands

    assert not availability.available("moths") and availability.available("other")
    assert availability.wait_s() == 30.0 and availability.due() == []
    waits = []
    for _ in range(4):
        clock.now += availability.wait_s()
        assert availability.due() == ["moths"]
        availability.failed_again("moths", REFUSED)
        waits.append(availability.unavailable()["moths"].retry_in_s)
    assert waits == [60.0, 100.0, 100.0, 100.0]
    availability.restored("moths")
    assert availability.available("moths") and availability.unavailable() == {}
    assert changes == ["changed", "changed"]  # lost, then back


def test_each_unavailable_pipeline_is_known_with_its_reason_and_error():
    availability = Availability()
    assert availability.unavailable() == {} and availability.failure("moths") is None
    availability.lost("moths", REFUSED)
    too_large = Failure("model_too_large", "takes 9 bytes loaded, over the memory budget")
    availability.lost("orders", too_large)
    lost = availability.unavailable()
    assert (lost["moths"].reason, lost["moths"].error) == ("download_refused", REFUSED.message)
    assert lost["orders"].reason == "over_budget"
    assert availability.failure("moths") == Failure(
        "model_load_failed", REFUSED.message, reason="download_refused"
    )


async def test_the_load_is_tried_again_in_the_background_until_the_host_serves():
    availability = Availability(first_s=0.01, max_s=0.02)
    tries: list[str] = []
    ticks: list[int] = []
    refusing = 3  # the file host refuses three more loads, then serves

    async def load(pipeline: str) -> Failure | None:
        nonlocal refusing
        tries.append(pipeline)
        refusing -= 1
        return REFUSED if refusing >= 0 else None

    async def tick() -> None:
        ticks.append(1)

    stop = asyncio.Event()
    retrying = asyncio.create_task(retry_loads(availability, load, stop, tick, tick_s=0.01))
    availability.lost("moths", REFUSED)  # after the loop started: it wakes for it
    for _ in range(500):
        if availability.available("moths"):
            break
        await asyncio.sleep(0.01)
    stop.set()
    await asyncio.wait_for(retrying, 5)
    assert availability.available("moths") and tries == ["moths"] * 4
    assert ticks  # the held tasks' keep-alive ran meanwhile


async def test_a_slow_retry_keeps_ticking_while_it_loads():
    availability = Availability(first_s=0.01, max_s=0.02)
    ticks_during_load: list[int] = []
    loading = False
    release = asyncio.Event()

    async def load(pipeline: str) -> Failure | None:
        nonlocal loading
        loading = True
        await release.wait()  # a slow download
        loading = False
        return None

    async def tick() -> None:
        if loading:
            ticks_during_load.append(1)
            if len(ticks_during_load) >= 3:
                release.set()

    stop = asyncio.Event()
    retrying = asyncio.create_task(retry_loads(availability, load, stop, tick, tick_s=0.01))
    availability.lost("moths", REFUSED)
    for _ in range(500):
        if availability.available("moths"):
            break
        await asyncio.sleep(0.01)
    stop.set()
    release.set()
    await asyncio.wait_for(retrying, 5)
    assert len(ticks_during_load) >= 3  # the held tasks kept alive, the watchdog fed
    assert availability.available("moths")
