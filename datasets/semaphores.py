"""Leave no ``/dev/shm/sem.mp-*`` behind, even when the whole process group is SIGKILLed.

Under forkserver and spawn, every multiprocessing lock, semaphore, event and queue is a named
POSIX semaphore in /dev/shm; its name stays there until the object is finalised, or until the
resource tracker cleans up after a dead process. When supervisord SIGKILLs the group
(``killasgroup``), the tracker dies too and each loader generation leaves its semaphores
behind (17 for two loader children). A named semaphore keeps working after its name is
unlinked, so once every child has opened them (each maps ``/dev/shm/sem.<name>``), we unlink
the names ourselves and drop the finalisers and tracker entries that would unlink them again.
"""

from __future__ import annotations

import time
from multiprocessing import process, resource_tracker, util
from multiprocessing.synchronize import SemLock
from typing import Any

_MAX_DEPTH = 4


def semlock_names(obj: Any, depth: int = 0) -> set[str]:
    """Names of the named semaphores reachable from ``obj`` through multiprocessing objects."""
    if isinstance(obj, SemLock):
        name = getattr(obj, "_semlock").name  # noqa: B009 - private, untyped
        return {name} if name else set()
    if depth >= _MAX_DEPTH or not type(obj).__module__.startswith("multiprocessing"):
        return set()
    names: set[str] = set()
    for value in getattr(obj, "__dict__", {}).values():
        names |= semlock_names(value, depth + 1)
    return names


def _mapped(pid: int) -> set[str]:
    try:
        with open(f"/proc/{pid}/maps") as maps:
            return {line.rsplit("/sem.", 1)[1].strip() for line in maps if "/dev/shm/sem." in line}
    except OSError:
        return set()


def wait_until_mapped(wanted: dict[int, set[str]], timeout_s: float) -> bool:
    """True once every pid maps every semaphore it is given (names without the leading /)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if all(names <= _mapped(pid) for pid, names in wanted.items()):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def unlink_names(names: set[str]) -> None:
    """Unlink now; cancel the finaliser and the tracker entry that would do it later."""
    from _multiprocessing import sem_unlink

    cleanup = getattr(SemLock, "_cleanup")  # noqa: B009 - private, untyped
    registry: dict[Any, Any] = getattr(util, "_finalizer_registry")  # noqa: B009
    for finalizer in list(registry.values()):
        args = getattr(finalizer, "_args", None) or ()
        if getattr(finalizer, "_callback", None) is cleanup and args and args[0] in names:
            finalizer.cancel()
    for name in names:
        try:
            sem_unlink(name)
        except FileNotFoundError:
            pass
        resource_tracker.unregister(name, "semaphore")


def use_prefix(prefix: str) -> None:
    """Name this process's (and its future children's) semaphores ``<prefix>-<random>``."""
    config = getattr(process.current_process(), "_config")  # noqa: B009 - private, untyped
    config["semprefix"] = prefix
