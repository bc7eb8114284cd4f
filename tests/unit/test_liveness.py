from __future__ import annotations

from worker.health.liveness import Liveness
from worker.settle import backoff_s


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


def test_nak_backoff_doubles_up_to_the_cap():
    assert [backoff_s(n, 2, 60) for n in (1, 2, 3, 4, 5, 6)] == [2, 4, 8, 16, 32, 60]


async def test_a_result_the_store_did_not_confirm_is_retried_in_process_before_any_nak():
    from config.errors import ResultsUnavailable
    from config.settings import NatsSettings
    from worker.outcome import Outcome
    from worker.schemas import Task
    from worker.settle import Settler

    class FlakyStore:
        def __init__(self, failures):
            self.failures, self.stored = failures, []

        async def store(self, result):
            if self.failures:
                self.failures -= 1
                raise ResultsUnavailable("results stream unavailable: timeout")
            self.stored.append(result)
            return True

    class Msg:
        def __init__(self):
            self.calls = []

        async def ack(self):
            self.calls.append("ack")

        async def nak(self, delay=None):
            self.calls.append("nak")

    task = Task("t1", "j1", "i1", "s3://b/k")
    settings = NatsSettings(store_retry_s=2.0)
    store, msg = FlakyStore(failures=3), Msg()
    settler = Settler(None, store, settings, "p", {"name": "p"}, max_deliver=2)  # type: ignore[arg-type]
    assert await settler.settle(task, msg, 1, Outcome(detections=[])) == "ok"
    assert msg.calls == ["ack"] and len(store.stored) == 1

    down, msg = FlakyStore(failures=1000), Msg()
    settler = Settler(None, down, NatsSettings(store_retry_s=0.5), "p", {"name": "p"}, 2)  # type: ignore[arg-type]
    assert await settler.settle(task, msg, 1, Outcome(detections=[])) == "retried"
    assert msg.calls == ["nak"] and down.stored == []
