"""Room for object bytes: how a read asks for it, and the budget that gives it.

A read asks once it knows the object's size and before it reads the body, so a read that
waits holds nothing, and every byte held belongs to a read that can finish: the budget never
deadlocks. One read is always let in, whatever its size, so a child holds at most
``max(limit_bytes, the largest object)``. Reads wait their turn in the order they asked, so a
large object is not passed over for ever by a stream of small ones; a read asking again
(a retry that found a larger size) holds bytes already and does not queue.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

Admit = Callable[[int, float], None]


def admit_all(_size_bytes: int, _wait_s: float) -> None:
    """No budget: every read goes ahead."""


@dataclass
class Reading:
    """What one object's read tells its caller while it runs.

    ``admit(size_bytes, wait_s)`` is called once the object's size is known (``max_bytes`` when
    the server does not say), again on a retry; it may wait up to ``wait_s`` for room and
    raises TransientError when there is none. ``retries`` gets one reason (``stalled``,
    ``throttled``, ``unavailable``) per retry made.
    """

    admit: Admit = admit_all
    retries: list[str] = field(default_factory=list)


class ByteBudget:
    """Bytes held by the reads of one process; thread-safe."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._changed = threading.Condition()
        self._held = 0
        self._waiting: deque[object] = deque()  # reads waiting for room, first come first
        self.peak_bytes = 0

    def take(self, extra_bytes: int, owned_bytes: int, wait_s: float) -> bool:
        """Hold ``extra_bytes`` more for a read that holds ``owned_bytes`` already; False when
        no room came within ``wait_s``."""
        with self._changed:
            turn = object()
            queued = owned_bytes == 0
            if queued:
                self._waiting.append(turn)
            try:
                if not self._changed.wait_for(
                    lambda: (
                        (not queued or self._waiting[0] is turn)
                        and (
                            self._held == owned_bytes
                            or self._held + extra_bytes <= self.limit_bytes
                        )
                    ),
                    timeout=max(0.0, wait_s),
                ):
                    return False
                self._held += extra_bytes
                self.peak_bytes = max(self.peak_bytes, self._held)
                return True
            finally:
                if queued:
                    self._waiting.remove(turn)
                    self._changed.notify_all()  # the next in line may go now

    def give(self, size_bytes: int) -> None:
        if size_bytes <= 0:
            return
        with self._changed:
            self._held -= size_bytes
            self._changed.notify_all()

    def held_bytes(self) -> int:
        with self._changed:
            return self._held
