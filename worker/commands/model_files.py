"""``inference-worker models fetch``: every served pipeline's model files (weights, labels)
into the host's cache before the first start, one line each saying how it is pinned; and the
``model file:`` lines of ``check`` (how each is pinned, whether it is cached; no download)."""

from __future__ import annotations

import sys

from config.errors import ConfigError, WorkerError
from config.redact import redact_url
from config.settings import Settings
from pipelines.models import stage_files
from worker.core.exits import CommandExit


def _served_files(settings: Settings) -> list[tuple[str, str | None]]:
    from pipelines.setup import choose_all

    return stage_files([chosen.pipeline for chosen in choose_all(settings)])


def fetch_command(settings: Settings) -> int:
    """Exit 0 when every file is in the cache (or read locally) and checked; 2 when one is
    refused or misdeclared (a wrong digest, too big, missing); 1 when one could not be
    downloaded (the network, a deadline)."""
    from pipelines.files.fetch import is_remote
    from worker.engine.build import model_files

    files = model_files(settings)
    failed = CommandExit.OK
    for uri, digest in _served_files(settings):
        try:
            got = files.fetch(uri, digest)
        except WorkerError as error:
            if isinstance(error, ConfigError) or not error.retryable:
                failed = CommandExit.CONFIG
            elif failed == CommandExit.OK:
                failed = CommandExit.FAILED
            print(f"not fetched: {redact_url(uri)}: {error}", file=sys.stderr)
            continue
        came = "downloaded" if got.downloaded else "cached"
        if not is_remote(uri):
            came = "local"
        print(f"{got.uri} {got.size_bytes} bytes sha256 {got.sha256} {got.pinned} ({came})")
    return failed


def pin_lines(settings: Settings) -> list[str]:
    """``model file: <uri> <pinned>, cached|not cached|local`` per file, or ``model file:
    <uri> refused: <why>`` for one that no download could bring; nothing downloaded (empty
    when the pipelines do not resolve: ``check`` reports that already)."""
    from pipelines.files.fetch import is_remote
    from worker.engine.build import model_files

    try:
        files = model_files(settings)  # a cache not the worker's own: check said so already
        served = _served_files(settings)
    except WorkerError:
        return []
    lines = []
    for uri, digest in served:
        try:
            pinned, cached = files.status(uri, digest)
        except ConfigError as error:  # a misdeclared digest, plain http:// elsewhere
            lines.append(f"model file: {redact_url(uri)} refused: {error}")
            continue
        where = ("cached" if cached else "not cached") if is_remote(uri) else "local"
        lines.append(f"model file: {redact_url(uri)} {pinned}, {where}")
    return lines
