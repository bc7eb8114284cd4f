"""The watchdog fires when the main thread cannot: a process wedged holding the GIL exits 1."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from worker.health.liveness import Liveness

WEDGED = textwrap.dedent(
    """
    import threading
    from worker.engine.faults import WedgingEngine
    from worker.health.liveness import Liveness
    from worker.health.watchdog import Watchdog

    live = Liveness(0.5, watchdog=Watchdog(1.0))
    live.set_held(3)
    wedged = WedgingEngine(None, {path!r}, "gil")
    threading.Thread(target=wedged.run_batch, args=([],), name="engine").start()
    threading.Event().wait(60)
    print("still alive")
    """
)


def test_a_process_wedged_holding_the_gil_dumps_every_stack_and_exits_1(tmp_path):
    script = WEDGED.format(path=str(tmp_path / "wedge-once"))
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 1
    assert "still alive" not in done.stdout
    assert "Timeout" in done.stderr
    assert "faults.py" in done.stderr  # the wedged thread's stack is in the log
    assert "Thread" in done.stderr


class FakeWatchdog:
    def __init__(self):
        self.events = []

    def arm(self):
        self.events.append("arm")

    def disarm(self):
        self.events.append("disarm")


def test_it_is_armed_only_while_work_is_held_and_rearmed_by_each_batch():
    dog = FakeWatchdog()
    live = Liveness(10, watchdog=dog)  # type: ignore[arg-type]
    live.batch_completed()  # idle: nothing to guard
    live.still_working()
    live.set_held(4)
    live.set_held(8)  # more work: the countdown keeps running
    live.still_working()  # rebuilding the loader: a fresh window, no progress recorded
    live.batch_completed()
    live.set_held(0)
    assert dog.events == ["arm", "arm", "arm", "disarm"]
