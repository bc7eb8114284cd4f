"""The model-file cache directory, shared by every process of the host.

Per file, a key ``<first 32 hex of sha256(the whole URI)>-<file name>`` names three files:
the content ``<key>``, its record ``<key>.json`` (the URI redacted, its sha256, size and how it
is pinned) and, while a download runs, a lock ``<key>.lock``. The whole URI is the file's
identity: its query and fragment are part of it (``dl?model=a`` and ``dl?model=b`` are two
files), an ``s3://`` URI is taken as S3 reads it (``clf#1.pth`` is a key, not a fragment);
only credentials are left out. Writes go to a temporary file in the same directory, are
flushed to disk and renamed over the target, so a reader sees a whole file or none. A cached
file whose record holds is read with no lock and no write (a read-only cache serves). Only a
download takes the lock, ``fcntl.flock`` on the key's lock file: the process that holds it
downloads, the others wait for it and then find the file; the holder removes the lock file as
it lets go. The directory must be the worker's own (``config.model_cache.own_problem``,
checked with the settings); the directories made for it are writable by their owner alone.
Imports nothing of the network.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast
from urllib.parse import urlsplit

from config.errors import ConfigError, TransientError
from config.model_cache import own_problem
from config.names import env_name
from config.redact import redact_url
from pipelines.files.digest import Pinned

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_NAME_CHARS = 64
_LOCK_POLL_S = 0.05
_CHUNK_BYTES = 1024 * 1024
_LOCK_REOPENS = 1000
_FULL = (errno.ENOSPC, errno.EDQUOT)  # a full disk, a user's quota spent
_KEY_FORM = "uri-v2 "
_OTHERS_WRITE = 0o022  # group or others may write
_DIR_MODE = 0o755


@dataclass(frozen=True)
class Record:
    sha256: str
    size_bytes: int
    pinned: Pinned


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


class Store:
    """The cache directory ``root`` (made on first use)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @staticmethod
    def key(uri: str) -> str:
        """The key of ``uri``'s file: the whole URI, credentials left out (an ``s3://`` URI
        as it is: its key is everything after the bucket's slash). ``_KEY_FORM`` sets these
        keys apart from those of the form before it, which left out a query and a fragment."""
        where, name = _identity(uri)
        safe = _UNSAFE.sub("_", name)[-_NAME_CHARS:] or "file"
        digest = hashlib.sha256(f"{_KEY_FORM}{where}".encode()).hexdigest()[:32]
        return f"{digest}-{safe}"

    def path(self, key: str) -> Path:
        return self.root / key

    @contextlib.contextmanager
    def locked(self, key: str, uri: str, wait_s: float) -> Iterator[None]:
        """Hold ``key``'s lock (to download ``uri``); TransientError when another process
        holds it past ``wait_s``; ConfigError naming the file when the cache cannot be
        written. The lock file is removed as the lock is let go."""
        path = self.root / f"{key}.lock"
        give_up = time.monotonic() + wait_s
        for _attempt in range(_LOCK_REOPENS):  # each reopen: a holder let go meanwhile
            fd = self._open_lock(path, uri)
            try:
                _flock(fd, uri, wait_s, give_up)
            except BaseException:
                os.close(fd)
                raise
            if _same_file(fd, path):
                break
            os.close(fd)  # its holder removed it as it let go: lock the one there now
        else:
            raise TransientError(
                f"model file {redact_url(uri)}: its lock file kept changing",
                kind="deadline_exceeded",
            )
        try:
            yield
        finally:
            with contextlib.suppress(OSError):  # while held: a waiter on it sees it gone
                path.unlink()
            os.close(fd)  # releases the lock

    def _open_lock(self, path: Path, uri: str) -> int:
        try:
            make_dirs(self.root)
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as error:
            raise ConfigError(
                f"{self.unusable(error)}; model file {redact_url(uri)} is not in the cache "
                "(or not as recorded) and this process cannot add it: fill the cache with "
                "`models fetch` as a user that can write it"
            ) from None

    def record(self, key: str) -> Record | None:
        """What was recorded of ``key``'s file, or None (none, or unreadable: made again)."""
        try:
            data = json.loads((self.root / f"{key}.json").read_text())
            return Record(
                str(data["sha256"]), int(data["size_bytes"]), cast(Pinned, data["pinned"])
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def cached_sha256(self, key: str) -> str | None:
        """The sha256 of ``key``'s content as it is on disk now, or None when there is none."""
        try:
            return file_sha256(self.path(key))
        except FileNotFoundError:
            return None

    def put(self, key: str, uri: str, data: bytes, record: Record) -> Path:
        """``data`` as ``key``'s content, then its record; each written whole or not at all."""
        try:
            for stale in self.root.glob(f".{key[:40]}.*.part"):  # a writer killed mid-write
                stale.unlink(missing_ok=True)  # (the key's lock is held: no writer now)
            self._write(key, data)
            shown = {"uri": redact_url(uri), **record.__dict__}
            self._write(f"{key}.json", json.dumps(shown, sort_keys=True).encode())
        except OSError as error:
            if error.errno in _FULL:  # may pass once space is freed: not the settings' fault
                raise self.full(uri, len(data)) from None
            raise self.unusable(error) from None  # a read-only directory, not a directory
        return self.path(key)

    def full(self, uri: str, needed_bytes: int) -> TransientError:
        free = ""
        with contextlib.suppress(OSError):
            free = f", {shutil.disk_usage(self.root).free} free"
        return TransientError(
            f"{env_name('model', 'cache_dir')}: no space left in {self.root} for model file "
            f"{redact_url(uri)} ({needed_bytes} bytes needed{free}): free space there or "
            "point the setting at a larger volume",
            kind="model_load_failed",
        )

    def unusable(self, error: OSError) -> ConfigError:
        return ConfigError(
            f"{env_name('model', 'cache_dir')}: cannot write model files in {self.root}: "
            f"{error.strerror or type(error).__name__}"
        )

    def drop(self, key: str) -> None:
        """Remove ``key``'s content (its record, a pin, stays)."""
        with contextlib.suppress(FileNotFoundError):
            self.path(key).unlink()

    def _write(self, name: str, data: bytes) -> None:
        make_dirs(self.root)
        fd, temporary = tempfile.mkstemp(dir=self.root, prefix=f".{name[:40]}.", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as file:
                os.fchmod(file.fileno(), 0o644)  # mkstemp's 0600 would hide it from other users
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, self.root / name)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
            raise


def _identity(uri: str) -> tuple[str, str]:
    """(``uri`` without credentials, its file name)."""
    if uri.startswith("s3://"):
        return uri, uri.rpartition("/")[2]
    parts = urlsplit(uri)
    host = parts.netloc.rpartition("@")[2].lower()
    where = f"{parts.scheme}://{host}{parts.path}"
    where += (f"?{parts.query}" if parts.query else "") + (
        f"#{parts.fragment}" if parts.fragment else ""
    )
    return where, parts.path.rstrip("/").rpartition("/")[2]


def make_dirs(root: Path) -> None:
    """``root`` and the directories above it that are missing, each writable by its owner
    alone (whatever the umask lets group or others write); then ``root`` is checked again
    (``own_problem``): one another account made first, say in /tmp, is refused."""
    missing = [d for d in (root, *root.parents) if not d.exists()]
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            directory.mkdir(mode=_DIR_MODE)
            os.chmod(directory, stat.S_IMODE(directory.stat().st_mode) & ~_OTHERS_WRITE)
    problem = own_problem(root, os.geteuid())
    if problem:
        raise ConfigError(problem)


def _flock(fd: int, uri: str, wait_s: float, give_up: float) -> None:
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= give_up:
                raise TransientError(
                    f"model file {redact_url(uri)}: another process of this host has "
                    f"been downloading it for over {wait_s:g}s",
                    kind="deadline_exceeded",
                ) from None
            time.sleep(_LOCK_POLL_S)


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``fd`` is still the file at ``path`` (not one removed from under it)."""
    try:
        there, held = path.stat(), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (there.st_dev, there.st_ino) == (held.st_dev, held.st_ino)
