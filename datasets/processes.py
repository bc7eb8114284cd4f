"""Processes under the worker: their state from /proc, killing and reaping them, and the
fork server and resource tracker that multiprocessing starts for us.

The one place that reaches into multiprocessing's private state (Python 3.11; tested by
``tests/unit/datasets/test_loader.py``, which stops them all): ``forkserver._forkserver`` with its
``_forkserver_pid``, ``_forkserver_alive_fd`` and ``_forkserver_address``, and
``resource_tracker._resource_tracker`` with ``_pid`` and ``_fd``. multiprocessing believes a
stopped fork server is alive and waits on it forever; here a stopped, dead or unreaped one
is killed and forgotten, so the next loader starts a fresh one.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Iterable
from multiprocessing import forkserver, resource_tracker

_POLL_S = 0.02
STOPPED_STATES = ("T", "t")
DEAD_STATES = ("Z", "X")
_PR_SET_CHILD_SUBREAPER = 36


def _stat(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name; [] once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()
    except OSError:
        return []


def state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (R, S, D, T, t, Z, ...); None once gone."""
    fields = _stat(pid)
    return fields[0] if fields else None


def start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid``; None once it is gone or a zombie. With the start
    time, a reused pid is not mistaken for the process we knew."""
    fields = _stat(pid)
    if len(fields) < 20 or fields[0] in DEAD_STATES:
        return None
    return int(fields[19]) if fields[19].isdigit() else None


def gone(pid: int) -> bool:
    """Dead: no process, or a zombie that no longer runs anything."""
    return state(pid) in (None, *DEAD_STATES)


def kill(pids: Iterable[int]) -> None:
    """SIGKILL each (it also ends a stopped process); a pid already gone is no error."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def wait_gone(pids: Iterable[int], timeout_s: float, *, reap_them: bool = False) -> list[int]:
    """Wait up to ``timeout_s`` for ``pids`` to die; return those still running (for example
    in uninterruptible sleep). With ``reap_them``, collect the ones that are our children
    (only for processes no multiprocessing object will wait for)."""
    pending = set(pids)
    deadline = time.monotonic() + timeout_s
    while True:
        for pid in list(pending):
            if reap_them:
                reap(pid)
            if gone(pid):
                pending.discard(pid)
        if not pending or time.monotonic() >= deadline:
            return sorted(pending)
        time.sleep(_POLL_S)


def reap(pid: int) -> bool:
    """Collect ``pid``'s exit status if it is our child and has exited; never blocks."""
    try:
        done, _status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return gone(pid)
    return done == pid


def become_subreaper() -> bool:
    """Orphans below us (loader children of a fork server we killed) become our children,
    so we can reap them before we exit instead of leaving them to init."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def forkserver_pid() -> int | None:
    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def forkserver_unfit() -> str | None:
    """Why the fork server cannot start children (stopped, dead), or None."""
    pid = forkserver_pid()
    if pid is None:
        return None
    current = state(pid)
    if current is None or current in DEAD_STATES:
        return None  # multiprocessing notices a dead one by itself and starts another
    if current in STOPPED_STATES or current == "D":
        return f"fork server {pid} is in state {current}"
    return None


def stop_forkserver(timeout_s: float) -> list[int]:
    """Kill the fork server, reap it, and forget it so the next start makes a fresh one.

    Returns the pids that could not be reaped in time (left behind, never waited on).
    """
    server = forkserver._forkserver
    pid = forkserver_pid()
    if pid is None:
        return []
    kill([pid])
    left = wait_gone([pid], timeout_s, reap_them=True)
    with contextlib.suppress(OSError, TypeError):
        os.close(server._forkserver_alive_fd)  # type: ignore[attr-defined]
    address = getattr(server, "_forkserver_address", None)
    if isinstance(address, str) and not address.startswith("\0"):
        with contextlib.suppress(OSError):
            os.unlink(address)
    server._forkserver_alive_fd = None  # type: ignore[attr-defined]
    server._forkserver_address = None  # type: ignore[attr-defined]
    server._forkserver_pid = None  # type: ignore[attr-defined]
    return left


def tracker_pid() -> int | None:
    return getattr(resource_tracker._resource_tracker, "_pid", None)


def replace_stopped_tracker(timeout_s: float) -> bool:
    """A stopped resource tracker stops reading its pipe; once the pipe is full, every new
    semaphore blocks us. Kill it; multiprocessing starts a new one on next use."""
    pid = tracker_pid()
    if pid is None or state(pid) not in (*STOPPED_STATES, "D"):
        return False
    kill([pid])
    if wait_gone([pid], timeout_s, reap_them=True):
        return False  # unkillable for now: multiprocessing would block reaping it; leave it
    tracker = resource_tracker._resource_tracker
    with contextlib.suppress(OSError, TypeError):
        os.close(tracker._fd)  # type: ignore[attr-defined]
    tracker._fd = None  # type: ignore[attr-defined]
    tracker._pid = None  # type: ignore[attr-defined]
    return True
