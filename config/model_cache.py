"""Where the model-file cache is, and whether it is the worker's own: a directory another
account could write is refused with the settings (``cross_checks.worker_problems``), before
anything is downloaded into it or read from it. Imports nothing of ours but ``names``."""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

from config.names import env_name

_OTHERS_WRITE = 0o022  # group or others may write


def cache_root(cache_dir: str, environ: Mapping[str, str]) -> Path:
    """``WORKER_MODEL__CACHE_DIR``, or its default (``default_root``)."""
    return Path(cache_dir) if cache_dir else default_root(environ)


def default_root(environ: Mapping[str, str]) -> Path:
    """``$XDG_CACHE_HOME/inference-worker/models``, or ``~/.cache/inference-worker/models``."""
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "inference-worker" / "models"


def own_problem(root: Path, uid: int) -> str | None:
    """Why ``root`` is not a cache directory of the user ``uid``'s own, or None when it is:
    it (or, while it does not exist, the directory it would be made in) must be owned by
    ``uid`` or root and writable by neither group nor others; each directory above it owned
    by ``uid`` or root and, when others may write it, sticky (as /tmp is). Otherwise another
    account could plant the files served as a model's."""
    setting = env_name("model", "cache_dir")
    path, first = root.resolve(), True
    for directory in (path, *path.parents):
        try:
            info = directory.stat()
        except FileNotFoundError:
            continue
        except OSError as error:
            return f"{setting}: cannot check {directory}: {error.strerror}"
        why = _not_own(info, uid, strict=first)
        first = False
        if why:
            fix = f"chmod go-w {directory}" if "writable" in why else f"chown {uid} {directory}"
            return (
                f"{setting}: {root} is not this worker's own: {directory} {why}, so another "
                f"account could plant model files there; {fix}, or point {setting} at a "
                "directory of the worker's user (mode 700 or 755)"
            )
    return None


def _not_own(info: os.stat_result, uid: int, strict: bool) -> str:
    if info.st_uid not in (uid, 0):
        return f"is owned by uid {info.st_uid}, not the worker's ({uid})"
    if info.st_mode & _OTHERS_WRITE and (strict or not info.st_mode & stat.S_ISVTX):
        return f"is writable by group or others (mode {stat.S_IMODE(info.st_mode):o})"
    return ""
