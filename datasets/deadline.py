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

    @property
    def deadline(self) -> float:
        """When the object's time is up, as ``time.monotonic()``."""
        return self._deadline

    def remaining_s(self) -> float:
        return max(0.0, self._deadline - time.monotonic())

    def expired(self) -> bool:
        return self.fired or time.monotonic() >= self._deadline

    def watch(self, sock: socket.socket | None) -> Watch:
        """Shut ``sock`` down at the deadline (None: nothing to watch, reads are checked).
        ``release`` on the answer ends the watch first (a kept-alive connection outlives the
        object it was read for)."""
        watch = Watch(self, sock)
        if sock is not None:
            timer = threading.Timer(self.remaining_s(), watch.cut)
            timer.daemon = True
            watch.timer = timer
            timer.start()
            self._timers.append(timer)
        return watch

    def __enter__(self) -> Cutoff:
        return self

    def __exit__(self, *_exc: Any) -> None:
        for timer in self._timers:
            timer.cancel()


class Watch:
    """One socket under a ``Cutoff``: shut down at the deadline unless released first."""

    def __init__(self, cutoff: Cutoff, sock: socket.socket | None) -> None:
        self._cutoff = cutoff
        self._sock = sock
        self._lock = threading.Lock()
        self._over = False
        self._was_cut = False
        self.timer: threading.Timer | None = None

    def cut(self) -> None:
        with self._lock:
            if self._over or self._sock is None:
                return
            self._over = self._was_cut = True
            self._cutoff.fired = True
            try:
                # The plain socket's shutdown, also for a TLS socket (whose own shutdown would
                # tear down its TLS state under a reader in another thread).
                socket.socket.shutdown(self._sock, socket.SHUT_RDWR)
            except OSError:
                pass  # already closed: nothing is blocked on it

    def release(self) -> bool:
        """No cut from now on; False when the socket was cut already (it is not reusable)."""
        with self._lock:
            self._over = True
        if self.timer is not None:
            self.timer.cancel()
        return not self._was_cut
