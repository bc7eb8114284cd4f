"""Where the model-file cache is, and whether it is the worker's own: a directory another
account could write is refused with the settings (``cross_checks.worker_problems``), before
anything is downloaded into it or read from it. Imports nothing of ours but ``names``."""

from __future__ import annotations

import os
import stat
from collections.abc import Collection, Mapping
from pathlib import Path

from config.names import env_name

_GROUP_WRITE, _OTHERS_WRITE = stat.S_IWGRP, stat.S_IWOTH


def cache_root(cache_dir: str, environ: Mapping[str, str]) -> Path:
    """``WORKER_MODEL__CACHE_DIR``, or its default (``default_root``)."""
    return Path(cache_dir) if cache_dir else default_root(environ)


def default_root(environ: Mapping[str, str]) -> Path:
    """``$XDG_CACHE_HOME/inference-worker/models``, or ``~/.cache/inference-worker/models``."""
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "inference-worker" / "models"


def own_problem(root: Path, uid: int, groups: Collection[int] | None = None) -> str | None:
    """Why ``root`` is not a cache directory of the user ``uid``'s own, or None when it is:
    it must be owned by ``uid`` or root and writable by no other account: not by others, and
    by its group only when that group is one of ``groups`` (the process's own gid and
    supplementary groups by default: Kubernetes' fsGroup, OpenShift's g=u). Each directory
    above it (while it does not exist, the one it would be made in too) must be owned by
    ``uid`` or root and, when another account may write it, sticky (as /tmp is: the worker
    makes its directory there itself, mode 700, and checks it again once made). Otherwise
    another account could plant the files served as a model's."""
    setting = env_name("model", "cache_dir")
    mine = set(groups) if groups is not None else {os.getegid(), *os.getgroups()}
    path = root.resolve()
    for directory in (path, *path.parents):
        try:
            info = directory.stat()
        except FileNotFoundError:
            continue
        except OSError as error:
            return f"{setting}: cannot check {directory}: {error.strerror}"
        why = _not_own(info, uid, mine, strict=directory == path)
        if why:
            return (
                f"{setting}: {root} is not this worker's own: {directory} {why}, so another "
                f"account could plant model files there; {_fix(directory, path, why, uid)}"
                f"point {setting} at a directory of the worker's user (mode 700 or 755)"
            )
    return None


def _fix(directory: Path, path: Path, why: str, uid: int) -> str:
    """The change to advise on the cache directory itself; none on a directory above it
    (such as a shared one), where the advice is a directory of the worker's own."""
    if directory != path:
        return ""
    return f"chmod go-w {directory}, or " if "writable" in why else f"chown {uid} {directory}, or "


def _not_own(info: os.stat_result, uid: int, groups: set[int], strict: bool) -> str:
    if info.st_uid not in (uid, 0):
        return f"is owned by uid {info.st_uid}, not the worker's ({uid})"
    mode = info.st_mode
    others = mode & _OTHERS_WRITE or (mode & _GROUP_WRITE and info.st_gid not in groups)
    if others and (strict or not mode & stat.S_ISVTX):
        return f"is writable by group or others (mode {stat.S_IMODE(mode):o})"
    return ""
