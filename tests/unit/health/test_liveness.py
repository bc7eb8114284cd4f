"""The stall rule behind /healthz: held work without a completed batch, never idleness."""

from __future__ import annotations

from worker.health.liveness import Liveness


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_idle_worker_is_never_stalled_and_its_progress_time_moves():
    clock = Clock()
    live = Liveness(60, clock)
    clock.now += 3600
    assert live.stalled_reason() is None
    assert live.last_progress() == clock.now


def test_held_work_without_a_completed_batch_stalls_after_the_timeout():
    clock = Clock()
    live = Liveness(60, clock)
    clock.now += 500  # idle for a long time first: that must not count
    live.set_held(4)
    clock.now += 59
    assert live.stalled_reason() is None
    clock.now += 2
    assert "4 tasks held" in (live.stalled_reason() or "")
    live.batch_completed()
    assert live.stalled_reason() is None


def test_settling_the_last_task_clears_the_stall():
    clock = Clock()
    live = Liveness(10, clock)
    live.set_held(1)
    clock.now += 20
    assert live.stalled_reason()
    live.set_held(0)
    assert live.stalled_reason() is None


def test_a_batch_that_advances_chunk_by_chunk_is_never_stalled_and_one_that_stops_is():
    clock = Clock()
    live = Liveness(60, clock)
    live.set_held(16)
    for _ in range(10):  # a batch of 500 s, a forward pass done every 50 s
        clock.now += 50
        live.advanced()
        assert live.stalled_reason() is None
    assert live.last_progress() == clock.now
    clock.now += 61  # then its next pass never ends
    assert "no work advanced for 61s" in (live.stalled_reason() or "")
