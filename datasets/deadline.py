"""One deadline per object, whatever the reads: a socket is shut down when its time is up.

A socket timeout bounds one read; a server that sends a byte just inside it each time holds
the reader for as long as it likes. ``Cutoff`` shuts the socket down at the object's
deadline, so the read blocked on it returns at once and the caller reports the deadline.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any


class Cutoff:
    def __init__(self, deadline_s: float) -> None:
        self._deadline = time.monotonic() + deadline_s
        self._timers: list[threading.Timer] = []
        self.fired = False

    def remaining_s(self) -> float:
        return max(0.0, self._deadline - time.monotonic())

    def expired(self) -> bool:
        return self.fired or time.monotonic() >= self._deadline

    def watch(self, sock: socket.socket | None) -> None:
        """Shut ``sock`` down at the deadline (None: nothing to watch, reads are checked)."""
        if sock is None:
            return
        timer = threading.Timer(self.remaining_s(), self._cut, args=(sock,))
        timer.daemon = True
        timer.start()
        self._timers.append(timer)

    def _cut(self, sock: socket.socket) -> None:
        self.fired = True
        try:
            # The plain socket's shutdown, also for a TLS socket (whose own shutdown would
            # tear down its TLS state under a reader in another thread).
            socket.socket.shutdown(sock, socket.SHUT_RDWR)
        except OSError:
            pass  # already closed: nothing is blocked on it

    def __enter__(self) -> Cutoff:
        return self

    def __exit__(self, *_exc: Any) -> None:
        for timer in self._timers:
            timer.cancel()
