"""A run directory per worker process: what it and its loader children leave on disk, in one
place named by the process index, emptied of dead processes' leftovers by the next process
with that index.

A SIGKILL of the whole process group (supervisord's ``killasgroup``, the OOM killer) runs no
finaliser, so three kinds of leftovers outlive a worker:

- ``pymp-*`` directories: ``multiprocessing.util.get_temp_dir`` makes one with
  ``tempfile.mkdtemp`` (so under ``tempfile.gettempdir()``, i.e. ``$TMPDIR``) in the main
  process for the fork server's socket, and children inherit it or make their own (a
  ``resource_sharer`` listener); only an ``atexit``-time finaliser removes them. ``use``
  points ``$TMPDIR`` and ``tempfile.tempdir`` at the run directory before anything of
  multiprocessing starts, so the fork server, the loader children (which inherit the
  environment) and every other temporary file of the process land there.
- ``/dev/shm/sem.mp-*``: every multiprocessing lock, semaphore and queue is a named POSIX
  semaphore, always in /dev/shm (glibc's ``sem_open``; no setting moves it), named
  ``<semprefix>-<random>`` with the process's ``_config['semprefix']`` (default ``/mp``),
  unlinked by a finaliser or by the resource tracker, which dies with the group. ``use``
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
same index (two test runs, a misconfiguration) never empties the first one's files.

Taking a slot and emptying it are two steps. ``claim`` only takes the lock: nothing is
removed. ``clear_leftovers`` then empties the slot and the index's other free slots
(removing the ``.N`` ones, so a killed overlap leaves nothing); the worker calls it only once
its start can no longer be refused for its settings (a port another process holds, a
pipeline or memory budget that cannot be), just before its first child process, so a start
that is refused removes nothing (it may have made the base, a slot and its lock file).
Emptying a slot is skipped, and said, while any marked process of it still lives.

The base and each slot must be real directories (not symlinks) of this user that no one else
can write, checked with ``lstat``: a planted symlink or foreign directory is refused, never
followed and emptied. So is a path too long for the fork server's Unix socket below it.
Every refusal is a ``ConfigError`` naming the setting (``WORKER_RUN_DIR``).
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import structlog

from config.errors import ConfigError
from config.names import env_name
from datasets import processes, semaphores

log = structlog.get_logger(__name__)
LOCK = "owner.lock"
MARK = "pid-"
SHM = Path("/dev/shm")
_MAX_SLOTS = 64
# The fork server's socket, ``<slot>/pymp-XXXXXXXX/listener-XXXXXXXX``, must fit AF_UNIX's
# 108-byte ``sun_path`` with its NUL.
_SOCKET_SUFFIX_BYTES = len("/pymp-XXXXXXXX/listener-XXXXXXXX")
_MAX_SOCKET_BYTES = 107


@dataclass
class RunDir:
    path: Path
    index: int
    semprefix: str
    lock_fd: int

    def release(self) -> None:
        """Unlock (the directory stays, for the next process to empty)."""
        os.close(self.lock_fd)


def semprefix_for(path: Path) -> str:
    """The multiprocessing semaphore prefix of a run directory (a leading ``/``, short)."""
    return "/mp-iw" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:10]


def claim(base: Path, index: int, named: str = "") -> RunDir:
    """Take (lock) the first free slot of ``index`` under ``base``; nothing is emptied yet
    (``clear_leftovers``), and ``use`` then makes it this process's temporary directory. A
    base or slot that cannot be used safely raises ``ConfigError`` starting with ``named``
    (the setting; by default ``WORKER_RUN_DIR=<base>``)."""
    try:
        run = _take(base, index)
    except (OSError, Unsafe) as error:
        setting = named or f"{env_name('run_dir')}={base}"
        raise ConfigError(f"{setting}: {_reason(error)}") from None
    log.info("run_dir_claimed", path=str(run.path))
    return run


def clear_leftovers(run: RunDir) -> None:
    """Now that the process will go on with its claimed slot: empty it of dead processes'
    leftovers, empty the index's other free slots (and remove the ``.N`` ones), and mark
    this process in it."""
    empty(run)
    _tidy_others(run.path.parent, run.index, run.path)
    mark_self(run.path)


class Unsafe(Exception):
    """A base or slot that is not ours alone, or that cannot hold the fork server's socket."""


def _reason(error: OSError | Unsafe) -> str:
    if isinstance(error, OSError):
        return f"cannot use it: {error.strerror or error}" + (
            f" ({error.filename})" if error.filename else ""
        )
    return str(error)


def _take(base: Path, index: int) -> RunDir:
    _check_socket_room(base / f"process-{index}")  # before anything is made
    _make_private(base)
    for slot in range(_MAX_SLOTS):
        path = base / (f"process-{index}" if slot == 0 else f"process-{index}.{slot}")
        _check_socket_room(path)
        fd = _open_slot(path)
        if fd is not None:
            return RunDir(path, index, semprefix_for(path), fd)
    raise Unsafe(f"all {_MAX_SLOTS} run directories of process {index} are in use")


def _open_slot(path: Path) -> int | None:
    """The slot made or checked, and locked; None when a live process holds it."""
    for _ in range(2):  # a free ``.N`` slot another process's claim removes meanwhile
        _make_private(path)
        try:
            return _lock(path)
        except FileNotFoundError:
            continue
    return _lock(path)


def _make_private(path: Path) -> None:
    """Make ``path`` (mode 0700) or check the one there: a real directory (``lstat``: not a
    symlink) of this user that neither group nor others can write."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    _check_private(path)


def _check_private(path: Path) -> None:
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise Unsafe(f"{path} is a symlink; refusing to follow it")
    if not stat.S_ISDIR(info.st_mode):
        raise Unsafe(f"{path} is not a directory")
    if info.st_uid != os.geteuid():
        raise Unsafe(f"{path} belongs to uid {info.st_uid}, not to this user ({os.geteuid()})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise Unsafe(f"{path} can be written by group or others (mode {info.st_mode & 0o7777:o})")


def _check_socket_room(path: Path) -> None:
    room = len(os.fsencode(str(path))) + _SOCKET_SUFFIX_BYTES
    if room > _MAX_SOCKET_BYTES:
        raise Unsafe(
            f"too long: the fork server's socket below {path} would take {room} bytes,"
            f" AF_UNIX allows {_MAX_SOCKET_BYTES}; choose a shorter directory"
        )


def _lock(path: Path) -> int | None:
    fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    try:
        current = os.lstat(path / LOCK).st_ino
    except FileNotFoundError:
        current = -1
    if os.fstat(fd).st_ino != current:  # a slot removed by ``_tidy_others`` meanwhile
        os.close(fd)
        return None
    return fd


def _tidy_others(base: Path, index: int, taken: Path) -> None:
    """Empty the index's other slots that are free and whose marks show no living process;
    remove the ``.N`` ones once empty (a killed overlap would keep its leftovers for good)."""
    first = f"process-{index}"
    for path in [*sorted(base.glob(f"{first}.*")), base / first]:
        overflow = path.name.removeprefix(f"{first}.").isdigit()
        if path == taken or not (overflow or path.name == first) or not os.path.lexists(path):
            continue
        try:
            _check_private(path)
            fd = _lock(path)
        except (OSError, Unsafe) as error:
            log.warning("run_dir_slot_skipped", path=str(path), reason=_reason(error))
            continue
        if fd is None:
            continue  # a live process's
        other = RunDir(path, index, semprefix_for(path), fd)
        try:
            if empty(other) and overflow:
                os.unlink(path / LOCK)
                os.rmdir(path)
        except OSError as error:
            log.warning("run_dir_slot_kept", path=str(path), reason=_reason(error))
        finally:
            other.release()


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


def empty(run: RunDir) -> bool:
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
        return False
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
    return True


def _remove(entry: str) -> None:
    try:
        if stat.S_ISDIR(os.lstat(entry).st_mode):  # lstat: a symlink is no directory here
            shutil.rmtree(entry, ignore_errors=True)  # does not follow symlinks inside
        else:
            os.unlink(entry)  # a symlink: the link itself
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
    multiprocessing semaphores are the run directory's (after ``clear_leftovers``, which
    would take this process's own files for leftovers)."""
    os.environ["TMPDIR"] = str(run.path)
    tempfile.tempdir = str(run.path)
    semaphores.use_prefix(run.semprefix)
