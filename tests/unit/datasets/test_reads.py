"""Reads in flight in a loader child: bounded by count and by bytes, never deadlocked."""

from __future__ import annotations

import queue
import threading
import time

from datasets.budget import ByteBudget
from datasets.loader import LoadRequest
from datasets.reads import ReadPool

WAIT_S = 10.0


def test_a_budget_lets_one_read_in_whatever_its_size_and_others_wait_for_room():
    budget = ByteBudget(100)
    assert budget.take(500, 0, WAIT_S)  # alone: goes ahead, so no object can wait forever
    assert not budget.take(10, 0, 0.05)  # full: a second read waits, here in vain
    budget.give(500)
    assert budget.take(60, 0, WAIT_S)
    assert not budget.take(60, 0, 0.05)  # 120 > 100
    assert budget.take(40, 0, WAIT_S)  # exactly full
    waiter = threading.Thread(target=lambda: took.append(budget.take(50, 0, WAIT_S)))
    took: list[bool] = []
    waiter.start()
    _until_waiting(budget, 1)
    assert took == []  # waiting for room
    budget.give(60)  # a decoded image frees its bytes: the waiting read goes on
    waiter.join(WAIT_S)
    assert took == [True]
    assert budget.held_bytes() == 90


def test_a_read_asking_again_for_more_never_waits_on_itself():
    budget = ByteBudget(100)
    assert budget.take(80, 0, WAIT_S)
    # A retry of the same read finds a larger size: it holds everything held, so it goes on.
    assert budget.take(200, 80, WAIT_S)
    assert budget.held_bytes() == 280
    assert budget.peak_bytes == 280


class Slots(threading.BoundedSemaphore):
    """The pool's read slots, counting each reader thread refused one (none was free)."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.refused: set[str] = set()

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        got = super().acquire(blocking, timeout)
        if not got:
            self.refused.add(threading.current_thread().name)
        return got


def _until_refused(slots: Slots, readers: int) -> None:
    """Until ``readers`` reader threads have each asked for a slot and found none (bounded)."""
    deadline = time.monotonic() + WAIT_S
    while len(slots.refused) < readers:
        assert time.monotonic() < deadline, f"only {sorted(slots.refused)} looked for a slot"
        time.sleep(0.01)


def test_the_pool_keeps_at_most_its_reads_in_flight_and_frees_a_slot_per_decoded_image():
    requests: queue.Queue = queue.Queue()
    gate = threading.Event()
    running: list[str] = []
    lock = threading.Lock()

    def read(uri, reading):
        reading.admit(10, WAIT_S)
        with lock:
            running.append(uri)
        gate.wait(WAIT_S)
        return b"x" * 10

    pool = ReadPool(requests, read, reads=3, budget_bytes=1000)
    slots = pool._slots = Slots(3)
    pool.start()
    try:
        for i in range(5):
            requests.put(LoadRequest(i, f"u{i}"))
        gate.set()
        first = [pool.next_read() for _ in range(3)]
        # Three reads done, none decoded: every reader looked for a slot and found none
        _until_refused(slots, 3)
        assert len(running) == 3
        assert requests.qsize() == 2  # no slot is free until an image is handed over
        stats = pool.finished(first[0])
        assert stats.in_flight == 2 and stats.held_bytes == 20
        fourth = pool.next_read()
        assert fourth is not None and fourth.data == b"x" * 10
        for done in [*first[1:], fourth]:
            pool.finished(done)
        last = pool.next_read()
        assert last is not None
        assert pool.finished(last).held_bytes == 0
    finally:
        pool.close()


def test_a_failed_read_holds_no_bytes_and_says_why():
    from config.errors import TransientError

    requests: queue.Queue = queue.Queue()

    def read(uri, reading):
        reading.admit(50, WAIT_S)
        reading.retries.append("stalled")
        raise TransientError("gone", kind="s3_unavailable")

    pool = ReadPool(requests, read, reads=2, budget_bytes=100).start()
    try:
        requests.put(LoadRequest(1, "u"))
        done = pool.next_read()
        assert done is not None
        assert done.data is None and done.failure is not None
        assert done.failure.kind == "s3_unavailable"
        assert done.held_bytes == 0 and done.retries == ("stalled",)
        assert pool.finished(done).held_bytes == 0
    finally:
        pool.close()


def _until_waiting(budget: ByteBudget, reads: int) -> None:
    """Until ``reads`` reads wait in the budget's line (bounded)."""
    deadline = time.monotonic() + WAIT_S
    while len(budget._waiting) < reads:
        assert time.monotonic() < deadline, f"{reads} reads never waited"
        time.sleep(0.005)


def test_a_large_read_waiting_for_room_is_not_passed_over_by_smaller_ones():
    budget = ByteBudget(100)
    assert budget.take(60, 0, WAIT_S)
    order: list[str] = []
    large = threading.Thread(target=lambda: order.append(f"large:{budget.take(90, 0, WAIT_S)}"))
    large.start()
    _until_waiting(budget, 1)
    # 60 + 30 fits, but the large read asked first: the small one waits its turn.
    small = threading.Thread(target=lambda: order.append(f"small:{budget.take(30, 0, WAIT_S)}"))
    small.start()
    _until_waiting(budget, 2)
    assert order == []
    budget.give(60)
    large.join(WAIT_S)
    assert order == ["large:True"]
    budget.give(90)
    small.join(WAIT_S)
    assert order == ["large:True", "small:True"]


class BrokenQueue:
    """A request queue whose reads fail as a closed multiprocessing queue's do."""

    def get(self, timeout: float) -> None:
        raise OSError("handle is closed")


def test_a_reader_that_cannot_go_on_ends_the_stream_loudly_instead_of_leaving_it_waiting():
    import pytest

    from datasets.reads import ReaderFailed

    pool = ReadPool(BrokenQueue(), lambda uri, reading: b"", reads=2, budget_bytes=100).start()
    try:
        with pytest.raises(ReaderFailed, match="handle is closed"):
            pool.next_read()
    finally:
        pool.close()
