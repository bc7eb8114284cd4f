"""Kept-alive http(s) connections for image reads: a few idle ones per origin, per process.

An image host across a WAN costs a TCP handshake and, over HTTPS, a TLS handshake (one round
trip each, and the TLS one costs CPU on both ends) before the first byte of every image when
each read opens its own connection. ``datasets.httpget`` takes a connection from here when one
to the same origin is idle, and gives it back once its answer was read whole.

- An origin is (scheme, host, port, the hosts allowed private addresses): a connection was
  made to an address checked under that policy, so it serves only reads under the same one.
- Per process: the pools are keyed by pid, and a forked child starts with none (its copies
  of the parent's sockets are dropped, never used), so a loader child never shares one.
- Bounded: at most ``per_origin`` idle connections per origin (the child's reads in flight),
  ``_MAX_ORIGINS`` origins (the least recently used one closed first), each idle for at most
  ``_MAX_IDLE_S``; one the server closed while idle (readable: EOF) is closed, not used.
- Closed at exit (``atexit``), and by ``close_idle``; a connection in use is the reader's
  to close when its read fails.
"""

from __future__ import annotations

import atexit
import http.client
import os
import select
import threading
import time
from collections import OrderedDict
from typing import NamedTuple

_MAX_ORIGINS = 8
_MAX_IDLE_S = 30.0


class Origin(NamedTuple):
    scheme: str
    host: str  # lower case
    port: int
    allowed: frozenset[tuple[str, int | None]]


class _Idle(NamedTuple):
    conn: http.client.HTTPConnection
    since: float  # time.monotonic()


class Pool:
    """Idle connections by origin; thread-safe (a loader child's reader threads share it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: OrderedDict[Origin, list[_Idle]] = OrderedDict()

    def take(self, origin: Origin) -> http.client.HTTPConnection | None:
        """An idle connection to ``origin`` still open, the most recently used first."""
        stale: list[http.client.HTTPConnection] = []
        found = None
        with self._lock:
            idle = self._idle.get(origin, [])
            now = time.monotonic()
            while idle and found is None:
                conn, since = idle.pop()
                if now - since > _MAX_IDLE_S or dropped(conn):
                    stale.append(conn)
                else:
                    found = conn
        for conn in stale:
            conn.close()
        return found

    def give(self, origin: Origin, conn: http.client.HTTPConnection, per_origin: int) -> None:
        """Keep ``conn`` for the next read of ``origin``, or close it when there is no room."""
        closing: list[http.client.HTTPConnection] = []
        with self._lock:
            idle = self._idle.setdefault(origin, [])
            self._idle.move_to_end(origin)
            if len(idle) < per_origin:
                idle.append(_Idle(conn, time.monotonic()))
            else:
                closing.append(conn)
            while len(self._idle) > _MAX_ORIGINS:
                _, evicted = self._idle.popitem(last=False)
                closing += [kept.conn for kept in evicted]
        for old in closing:
            old.close()

    def idle_count(self) -> int:
        with self._lock:
            return sum(len(idle) for idle in self._idle.values())

    def close_all(self) -> None:
        with self._lock:
            everything = [kept.conn for idle in self._idle.values() for kept in idle]
            self._idle.clear()
        for conn in everything:
            conn.close()


def dropped(conn: http.client.HTTPConnection) -> bool:
    """The server closed this idle connection, or sent bytes nobody asked for."""
    sock = conn.sock
    if sock is None:
        return True
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


_pools: dict[int, Pool] = {}
_pools_lock = threading.Lock()


def pool() -> Pool:
    """This process's pool, made on first use."""
    pid = os.getpid()
    with _pools_lock:
        found = _pools.get(pid)
        if found is None:
            found = _pools[pid] = Pool()
        return found


def close_idle() -> None:
    """Close this process's idle connections (a loader child's stream ending, exit)."""
    with _pools_lock:
        found = _pools.pop(os.getpid(), None)
    if found is not None:
        found.close_all()


def _forget_in_child() -> None:
    """A forked child drops the parent's pools unused (their sockets are the parent's)."""
    global _pools_lock
    _pools_lock = threading.Lock()  # a fork may have copied it held by another thread
    _pools.clear()


os.register_at_fork(after_in_child=_forget_in_child)
atexit.register(close_idle)
