"""A run directory per worker process: what it and its loader children leave on disk, in one
place named by the process index, emptied of dead processes' leftovers by the next process
with that index.

A SIGKILL of the whole process group (supervisord's ``killasgroup``, the OOM killer) runs no
finaliser, so three kinds of leftovers outlive a worker:

- ``pymp-*`` directories: ``multiprocessing.util.get_temp_dir`` makes one with
  ``tempfile.mkdtemp`` (so under ``tempfile.gettempdir()``, i.e. ``$TMPDIR``) in the main
  process for the fork server's socket, and children inherit it or make their own (a
  ``resource_sharer`` listener); only an ``atexit``-time finaliser removes them. ``claim``
  (with ``use``) points ``$TMPDIR`` and ``tempfile.tempdir`` at the run directory before anything of
  multiprocessing starts, so the fork server, the loader children (which inherit the
  environment) and every other temporary file of the process land there.
- ``/dev/shm/sem.mp-*``: every multiprocessing lock, semaphore and queue is a named POSIX
  semaphore, always in /dev/shm (glibc's ``sem_open``; no setting moves it), named
  ``<semprefix>-<random>`` with the process's ``_config['semprefix']`` (default ``/mp``),
  unlinked by a finaliser or by the resource tracker, which dies with the group. ``claim``
  sets a prefix of this run directory's own (``/mp-iw<hash>``), so its semaphores can be
  told from any other process's. (``datasets.semaphores`` unlinks a loader's names as soon
  as every child has opened them; this is for what a kill in between leaves.)
- ``/dev/shm/torch_<pid>_*``: torch's shared-memory segments for tensors sent between
  processes, named by the creating process's pid; with the ``file_descriptor`` strategy
  (Linux's default) unlinked right after creation, so only a kill in that instant leaves one
  (the loader sends arrays through its pipe, not torch tensors). Every process of ours
  writes a ``pid-<pid>-<start time>`` mark in the run directory, so the next process knows
  whose segments are whose.

Ownership is an ``flock`` on ``owner.lock``: the kernel drops it when its process dies, even
by SIGKILL. A process takes the first slot of its index whose lock is free
(``process-<index>``, then ``process-<index>.1``, ...), so a second live process with the
same index (two test runs, a misconfiguration) never empties the first one's files. Emptying
is skipped, and said, while any marked process of the slot still lives.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import structlog

from datasets import processes, semaphores

log = structlog.get_logger(__name__)
LOCK = "owner.lock"
MARK = "pid-"
SHM = Path("/dev/shm")
_MAX_SLOTS = 64


@dataclass
class RunDir:
    path: Path
    semprefix: str
    lock_fd: int

    def release(self) -> None:
        """Unlock (the directory stays, for the next process to empty)."""
        os.close(self.lock_fd)


def semprefix_for(path: Path) -> str:
    """The multiprocessing semaphore prefix of a run directory (a leading ``/``, short)."""
    return "/mp-iw" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:10]


def claim(base: Path, index: int) -> RunDir:
    """Take the first free slot of ``index`` under ``base`` and empty it of dead processes'
    leftovers; ``use`` then makes it this process's temporary directory."""
    base.mkdir(parents=True, exist_ok=True)
    for slot in range(_MAX_SLOTS):
        path = base / (f"process-{index}" if slot == 0 else f"process-{index}.{slot}")
        path.mkdir(mode=0o700, exist_ok=True)
        fd = _lock(path)
        if fd is not None:
            break
    else:
        raise RuntimeError(f"all {_MAX_SLOTS} run directories of process {index} are in use")
    run = RunDir(path, semprefix_for(path), fd)
    empty(run)
    mark_self(path)
    log.info("run_dir_claimed", path=str(path))
    return run


def _lock(path: Path) -> int | None:
    fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def marked(path: Path) -> list[tuple[int, int | None]]:
    """(pid, start time) of every process that marked itself in ``path``."""
    found = []
    for name in os.listdir(path):
        if name.startswith(MARK):
            pid, _, started = name[len(MARK) :].partition("-")
            if pid.isdigit():
                found.append((int(pid), int(started) if started.isdigit() else None))
    return found


def _alive(pid: int, started: int | None) -> bool:
    """The very process that wrote the mark (a reused pid has another start time)."""
    return started is not None and processes.start_time(pid) == started


def empty(run: RunDir) -> None:
    """Remove what the slot's dead processes left: its files, their semaphores and torch
    segments. Held by us (the lock), so no process of ours is using it, unless a marked one
    still lives (a loader child outliving its killed parent for a moment): then keep all."""
    marks = marked(run.path)
    living = [pid for pid, started in marks if _alive(pid, started)]
    if living:
        log.warning(
            "run_dir_not_emptied",
            path=str(run.path),
            living=living,
            hint="processes of a previous worker still run; the next start empties it",
        )
        return
    leftovers = glob.glob(str(SHM / f"sem.{run.semprefix.lstrip('/')}-*"))
    for pid, _ in marks:
        leftovers += glob.glob(str(SHM / f"torch_{pid}_*"))
    for name in os.listdir(run.path):
        if name != LOCK:
            leftovers.append(str(run.path / name))
    for entry in leftovers:
        _remove(entry)
    if leftovers:
        log.info("run_dir_emptied", path=str(run.path), removed=len(leftovers))


def _remove(entry: str) -> None:
    try:
        if os.path.isdir(entry) and not os.path.islink(entry):
            shutil.rmtree(entry, ignore_errors=True)
        else:
            os.unlink(entry)
    except FileNotFoundError:
        pass


def mark_self(path: Path) -> None:
    """Write this process's mark (pid and start time) in ``path``."""
    pid = os.getpid()
    (path / f"{MARK}{pid}-{processes.start_time(pid) or 0}").touch()


def mark_child() -> None:
    """In a loader child: mark it in the run directory, if its temp dir is one."""
    path = Path(tempfile.gettempdir())
    if (path / LOCK).exists():
        mark_self(path)


def use(run: RunDir) -> None:
    """From now on, this process's (and its future children's) temporary files and
    multiprocessing semaphores are the run directory's."""
    os.environ["TMPDIR"] = str(run.path)
    tempfile.tempdir = str(run.path)
    semaphores.use_prefix(run.semprefix)
