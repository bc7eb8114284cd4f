"""A watchdog that works when the main thread cannot.

``faulthandler.dump_traceback_later`` runs on a C thread of its own: it fires even when every
Python thread is blocked in C code or one of them holds the GIL. When it fires it writes every
thread's stack to stderr (supervisord's log) and exits the process with status 1, so
supervisord starts a fresh one before NATS redelivery runs out.
"""

from __future__ import annotations

import faulthandler
import sys
from typing import TextIO


class Watchdog:
    def __init__(self, timeout_s: float, stream: TextIO | None = None) -> None:
        self.timeout_s = timeout_s
        self._stream = stream or sys.stderr
        self.armed = False

    def arm(self) -> None:
        """Start (or restart) the countdown."""
        faulthandler.dump_traceback_later(
            self.timeout_s, repeat=False, file=self._stream, exit=True
        )
        self.armed = True

    def disarm(self) -> None:
        if self.armed:
            faulthandler.cancel_dump_traceback_later()
            self.armed = False
