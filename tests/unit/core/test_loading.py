"""A model load has a deadline (``worker.core.loading.Loads``): past it the load is a
``load_timeout`` failure of its pipeline, never waited for longer; a load thread that does not
return is never joined by a second one, and one still running at twice its deadline asks for
a restart."""

from __future__ import annotations

import asyncio
import threading

import pytest

from config.errors import DeviceFailed, Failure
from worker.core.availability import Availability, is_unavailable, retry_loads
from worker.core.loading import LOAD_TIMEOUT, Loads

DEADLINE_S = 0.2


class HungLoad:
    """A load that hangs until released (a file host trickling its answer's headers)."""

    def __init__(self, result: Failure | None = None) -> None:
        self.calls = 0
        self.release = threading.Event()
        self.result = result

    def __call__(self, pipeline: str) -> Failure | None:
        self.calls += 1
        self.release.wait(30)  # bounded: the test releases it
        return self.result


async def test_a_load_within_its_deadline_is_its_result_and_ticks_meanwhile():
    ticks: list[str] = []

    async def tick() -> None:
        ticks.append("tick")

    def slow(pipeline: str) -> Failure | None:
        threading.Event().wait(0.1)
        return None

    loads = Loads(slow, deadline_s=30.0)
    assert await loads.load("moths", tick, tick_s=0.01) is None
    assert ticks  # the held tasks kept alive while it loaded
    assert loads.running() == {}


async def test_a_hung_load_is_a_load_timeout_and_starts_no_second_thread_while_it_runs():
    hung = HungLoad()
    ticks: list[str] = []

    async def tick() -> None:
        ticks.append("tick")

    loads = Loads(hung, deadline_s=DEADLINE_S)
    try:
        failure = await loads.load("moths", tick, tick_s=0.05)
        assert failure is not None and is_unavailable(failure)
        assert failure.reason == LOAD_TIMEOUT
        assert "WORKER_MODEL__LOAD_DEADLINE_S=0.2" in failure.message
        ticked = len(ticks)
        again = await loads.load("moths", tick, tick_s=0.05)  # a retry while it still runs
        assert again is not None and again.reason == LOAD_TIMEOUT
        assert len(ticks) == ticked  # past the deadline nothing is kept alive
        assert hung.calls == 1 and list(loads.running()) == ["moths"]
    finally:
        hung.release.set()
    for _ in range(200):  # the thread ends once released
        if not loads.running():
            break
        await asyncio.sleep(0.01)
    assert await loads.load("moths") is None  # a fresh load once it has ended
    assert hung.calls == 2


async def test_a_load_still_running_at_twice_its_deadline_asks_for_a_restart_once():
    hung = HungLoad()
    wedged: list[str] = []
    loads = Loads(hung, deadline_s=DEADLINE_S, wedged=wedged.append)
    try:
        await loads.load("moths")
        for _ in range(300):
            if wedged:
                break
            await asyncio.sleep(0.01)
        await loads.load("moths")
        await asyncio.sleep(3 * DEADLINE_S)
    finally:
        hung.release.set()
    assert len(wedged) == 1 and "'moths' is wedged" in wedged[0]


async def test_a_load_that_ends_in_time_asks_for_no_restart():
    hung = HungLoad()
    wedged: list[str] = []
    loads = Loads(hung, deadline_s=DEADLINE_S, wedged=wedged.append)
    hung.release.set()
    assert await loads.load("moths") is None
    await asyncio.sleep(3 * DEADLINE_S)
    assert wedged == []


async def test_a_device_failure_under_the_load_is_raised_as_the_engine_raised_it():
    def broken(pipeline: str) -> Failure | None:
        raise DeviceFailed("CUDA error: an illegal memory access was encountered")

    with pytest.raises(DeviceFailed):
        await Loads(broken, deadline_s=5.0).load("moths")


async def test_a_wedged_pipeline_stays_unavailable_through_its_retries_then_comes_back():
    """The retries of ``availability`` through ``Loads``: each one while the thread hangs fails
    at once (``load_timeout``, one thread in all); once it ends, the next loads it again."""
    hung = HungLoad()
    loads = Loads(hung, deadline_s=DEADLINE_S)
    availability = Availability(first_s=0.05, max_s=0.05)
    stop = asyncio.Event()
    first = await loads.load("moths")
    assert first is not None
    availability.lost("moths", first)

    async def tick() -> None:
        return None

    retrying = asyncio.create_task(retry_loads(availability, loads.load, stop, tick, 0.05))
    try:
        for _ in range(300):
            lost = availability.unavailable().get("moths")
            if lost is not None and lost.loads_failed >= 3:
                break
            await asyncio.sleep(0.01)
        lost = availability.unavailable()["moths"]
        assert lost.loads_failed >= 3 and lost.reason == LOAD_TIMEOUT and hung.calls == 1
        hung.release.set()
        for _ in range(300):
            if availability.available("moths"):
                break
            await asyncio.sleep(0.01)
        assert availability.available("moths")
    finally:
        hung.release.set()
        stop.set()
        await retrying


async def test_the_loads_at_start_past_their_deadline_fail_the_start():
    """At start a hung load ends the start (exit 1, for a restart), not ``starting`` until
    healthwatch's bound."""
    from config.errors import TransientError
    from worker.engine.build import _within_deadline

    hung = asyncio.get_running_loop().create_future()
    with pytest.raises(TransientError, match="WORKER_MODEL__LOAD_DEADLINE_S"):
        await _within_deadline(hung, DEADLINE_S)
    done = asyncio.get_running_loop().create_future()
    done.set_result(None)
    assert await _within_deadline(done, DEADLINE_S) is None
