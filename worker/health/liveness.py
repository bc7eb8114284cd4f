"""Liveness: what /livez answers (and /readyz before the source's problem), from the batches'
progress and the held tasks: what only a restart mends."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import structlog

from worker.health.watchdog import Watchdog

log = structlog.get_logger(__name__)


class Liveness:
    """The stall rule: stalled while tasks are held and no work advanced for stall_timeout_s.

    Work advances where it happens: a batch completed, or a part of one (``advanced``: a
    detector or classifier chunk's forward pass done, a tick from the engine thread), so a
    batch longer than the stall timeout or the watchdog's window that advances is no stall,
    and a forward pass that freezes still is, within the same timeouts.

    An idle worker is never stalled: while nothing is held, "last progress" keeps moving.
    """

    def __init__(
        self,
        stall_timeout_s: float,
        clock: Callable[[], float] = time.time,
        watchdog: Watchdog | None = None,
    ) -> None:
        self.stall_timeout_s = stall_timeout_s
        self._clock = clock
        self._watchdog = watchdog
        self._lock = threading.Lock()
        self._held = 0
        self._last_progress = clock()
        self._restart: str | None = None  # why only a new process can serve, once it is so

    def set_held(self, held: int) -> None:
        with self._lock:
            if self._held == 0 or held == 0:
                # Work taken on by an idle worker, or the last of it settled: the clock starts now.
                self._last_progress = self._clock()
                if self._watchdog is not None and held:
                    self._watchdog.arm()  # armed only while work is held
                elif self._watchdog is not None:
                    self._watchdog.disarm()  # an idle worker is never killed
            self._held = held

    def batch_completed(self) -> None:
        self.advanced()

    def advanced(self) -> None:
        """Work advanced (a batch, or a chunk of one, done; any thread): the stall clock and
        the watchdog start over."""
        with self._lock:
            self._last_progress = self._clock()
            self._rearm_locked()

    def loading(self) -> None:
        """A model is loading for the held tasks: progress, not a stall (the stall clock and
        the watchdog start over)."""
        self.batch_completed()

    def waiting_on_source(self) -> None:
        """The engine is idle and finished results wait for the task source's server (its
        answers bounded by their deadlines): blocked, not wedged; as ``loading``."""
        self.batch_completed()

    def still_working(self) -> None:
        """The worker is acting (e.g. rebuilding its loader) without completing a batch: give
        the watchdog a fresh window, but leave the stall clock alone."""
        with self._lock:
            self._rearm_locked()

    def _rearm_locked(self) -> None:
        """A fresh watchdog window, while work is held (the watchdog is disarmed otherwise)."""
        if self._watchdog is not None and self._held:
            self._watchdog.arm()

    def must_restart(self, reason: str) -> None:
        """Only a new process can serve again (the device failed for good): every probe answers
        503 ``restart: <reason>`` from now until the process has given back its tasks and
        exited. The first reason stays."""
        with self._lock:
            self._restart = self._restart or reason

    def restart_reason(self) -> str | None:
        with self._lock:
            return self._restart

    @property
    def held(self) -> int:
        return self._held

    def last_progress(self) -> float:
        with self._lock:
            return self._clock() if self._held == 0 else self._last_progress

    def stalled_reason(self) -> str | None:
        with self._lock:
            if self._held == 0:
                return None
            idle_s = self._clock() - self._last_progress
            if idle_s < self.stall_timeout_s:
                return None
            return (
                f"{self._held} tasks held and no work advanced for {idle_s:.0f}s "
                f"(stall timeout {self.stall_timeout_s:g}s)"
            )
