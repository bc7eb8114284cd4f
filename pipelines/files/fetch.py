"""Model files by URI, checked and cached: ``ModelFiles`` reads weights and labels.

- A path (or ``file://``): read as it is, its declared digest checked; nothing cached.
- ``https://``, ``s3://`` (and ``http://`` to a loopback host, or with the full sha256
  declared): downloaded once per host into the cache directory (``store.Store``) under a lock,
  so processes of the host starting together download once; used from there with no network
  while its content fits what is declared or was recorded.
- Downloads: capped at ``max_bytes`` (and at the size its publisher states) while reading,
  one deadline for all attempts (``datasets.uris``: connect and stall timeouts, retries),
  redirects only to the same scheme; a publisher's file is tried at each of its hosts in
  turn (``hosts.Hosts``). A file whose size is not the published one, or whose sha256 is not
  the one declared (or verified by the operator), or not the one recorded for its URI at its
  first download, is refused (both values in the message) and nothing of it is kept.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

import structlog

from config.cross_checks import loopback_url
from config.errors import ConfigError, PermanentError, TransientError, WorkerError
from config.names import env_name
from config.redact import redact_url
from datasets.uris import SourceConfig, read_bytes
from pipelines.files.digest import Pinned, Wanted, refusal, size_refusal
from pipelines.files.hosts import Hosts
from pipelines.files.store import Record, Store, file_sha256

log = structlog.get_logger(__name__)
MAX_FILE_BYTES = 4 * 1024**3
_LOCK_SLACK_S = 60.0  # past the download deadline: writing the file, a slow disk


@dataclass(frozen=True)
class Fetched:
    """A model file at hand: where it lies (None when it was read uncached), its sha256, size,
    how it is pinned, and whether this call downloaded it."""

    uri: str  # redacted
    path: Path | None
    sha256: str
    size_bytes: int
    pinned: Pinned
    downloaded: bool


def is_remote(uri: str) -> bool:
    return urlsplit(uri).scheme in ("https", "http", "s3")


@dataclass(frozen=True)
class Pins:
    """What the operator asks of remote files: sha256s it verified, by file name, and whether
    a remote file without one is refused (``strict``)."""

    verified: Mapping[str, str] | None = None
    strict: bool = False


class ModelFiles:
    """Reads model files; ``cache_dir`` None: remote files are read into memory each time
    (digests still checked), for tests and benchmarks that load a model in process.
    ``hosts``: a publisher's other hosts and stated sizes; ``pins``: the operator's digests."""

    def __init__(
        self,
        sources: SourceConfig,
        cache_dir: Path | None = None,
        max_bytes: int = MAX_FILE_BYTES,
        deadline_s: float = 600.0,
        hosts: Hosts | None = None,
        pins: Pins | None = None,
    ) -> None:
        self._sources = sources
        self._store = Store(cache_dir) if cache_dir is not None else None
        self.max_bytes = max_bytes
        self.deadline_s = deadline_s
        self._hosts = hosts or Hosts()
        self._pins = pins or Pins()

    def read(self, uri: str, digest: str | None = None) -> bytes:
        """The file's bytes, checked against ``digest`` (a sha256 or a prefix of one)."""
        return self._get(uri, digest, keep=True)[1]

    def fetch(self, uri: str, digest: str | None = None) -> Fetched:
        """The file cached (downloaded when it is not) and checked; its bytes not kept."""
        return self._get(uri, digest, keep=False)[0]

    def status(self, uri: str, digest: str | None = None) -> tuple[Pinned, bool]:
        """How the file is pinned and whether it is in the cache now; nothing downloaded.
        ConfigError when it would be refused before any download (plain http:// elsewhere)."""
        wanted = self._wanted(uri, digest)
        refused = _insecure(uri, wanted)
        if refused is not None:
            raise refused
        if not is_remote(uri) or self._store is None:
            return wanted.pinned(False), False
        key = self._store.key(uri)
        record = self._store.record(key)
        cached = record is not None and _fits(wanted, record)
        cached = cached and self._store.path(key).is_file()
        return wanted.pinned(True), cached

    def _wanted(self, uri: str, digest: str | None) -> Wanted:
        """What ``uri``'s file must be: the operator's verified sha256 (else the declared
        digest), the published size; ConfigError when strict and no sha256 is verified."""
        name, pins = _file_name(uri), self._pins.verified or {}
        verified = pins.get(uri) or pins.get(name)
        size = self._hosts.size_of(uri)
        wanted = Wanted.parse(verified or digest, uri, verified is not None, size)
        if self._pins.strict and is_remote(uri) and not wanted.full:
            digests = env_name("model", "file_digests")
            raise ConfigError(
                f"model file {redact_url(uri)}: no verified sha256 for it and "
                f"{env_name('model', 'require_digests')} is true: add {name}=<its sha256> to "
                f"{digests}"
            )
        return wanted

    def _get(self, uri: str, digest: str | None, keep: bool) -> tuple[Fetched, bytes]:
        wanted = self._wanted(uri, digest)
        scheme = urlsplit(uri).scheme
        if scheme in ("", "file"):
            return _local(uri, wanted, keep)
        refused = _insecure(uri, wanted)
        if refused is not None:
            raise refused
        if not is_remote(uri):
            raise ConfigError(f"model file {redact_url(uri)}: give a path, https:// or s3:// URI")
        if self._store is None:
            data, _served_by = self._download(uri, wanted)
            sha256 = _checked(uri, data, wanted, None)
            return Fetched(
                redact_url(uri), None, sha256, len(data), wanted.pinned(True), True
            ), data
        hit = _hit(self._store, uri, wanted, keep)  # no lock, no write: a read-only cache serves
        if hit is not None:
            return hit
        with self._store.locked(self._store.key(uri), uri, self.deadline_s + _LOCK_SLACK_S):
            return self._cached(uri, wanted, keep)

    def _cached(self, uri: str, wanted: Wanted, keep: bool) -> tuple[Fetched, bytes]:
        """Under the key's lock: the cached file when it fits (another process may have just
        written it), else downloaded and kept."""
        assert self._store is not None
        store, key = self._store, self._store.key(uri)
        hit = _hit(store, uri, wanted, keep)
        if hit is not None:
            return hit
        record = store.record(key)
        if record is not None and wanted.fits(record.sha256):
            _changed(store, key, uri, record)
            store.drop(key)  # missing or damaged: downloaded again, against the same pin
        # The recorded sha256 holds unless a full one is declared, or a new prefix it misses.
        held = record is not None and not wanted.full and wanted.fits(record.sha256)
        pin = record.sha256 if held and record is not None else None
        data, served_by = self._download(uri, wanted)
        sha256 = _checked(uri, data, wanted, pin)
        pinned = wanted.pinned(True)
        path = store.put(key, uri, data, Record(sha256, len(data), pinned))
        log.info(
            "model_file_downloaded",
            uri=redact_url(uri),
            served_by=redact_url(served_by),
            sha256=sha256,
            bytes=len(data),
            pinned=pinned,
        )
        fetched = Fetched(redact_url(uri), path, sha256, len(data), pinned, True)
        return fetched, data if keep else b""

    def _download(self, uri: str, wanted: Wanted) -> tuple[bytes, str]:
        """The remote file's bytes, and the URL that served them: the first of its hosts that
        serves them, all within one deadline; an error naming every host tried and its
        answer when none does. A file larger than its published size is refused as it is
        read (or by its Content-Length), not tried elsewhere."""
        give_up = time.monotonic() + self.deadline_s
        published = wanted.size_bytes if (wanted.size_bytes or 0) <= self.max_bytes else None
        tried: list[tuple[str, WorkerError]] = []
        for candidate in self._hosts.candidates(uri):
            remaining_s = give_up - time.monotonic()
            if remaining_s <= 0:
                break
            try:
                data = self._download_from(candidate, wanted, remaining_s)
            except WorkerError as error:
                if error.kind == "too_large" and published is not None:
                    raise size_refusal(uri, published, _larger(error)) from None
                if error.kind == "too_large" or isinstance(error, ConfigError):
                    raise
                log.warning("model_file_host_failed", uri=redact_url(candidate), error=str(error))
                tried.append((candidate, error))
                continue
            return data, candidate
        raise _none_served(uri, tried, self.deadline_s)

    def _download_from(self, candidate: str, wanted: Wanted, deadline_s: float) -> bytes:
        """One host's bytes: the source rules of ``datasets.uris`` with this cache's size
        cap and ``deadline_s``; the URI's own host may be a private address (the operator
        named it)."""
        cap = min(self.max_bytes, wanted.size_bytes or self.max_bytes)
        config = replace(
            self._sources,
            max_bytes=cap,
            object_deadline_s=deadline_s,
            file_roots=(),
            reads_in_flight=1,
        )
        if urlsplit(candidate).scheme != "s3":
            host = urlsplit(candidate).netloc.rpartition("@")[2]
            config = replace(config, allowed_hosts=frozenset({host}))
        return read_bytes(candidate, config)


def _none_served(uri: str, tried: list[tuple[str, WorkerError]], deadline_s: float) -> WorkerError:
    """The error of a file no host served: each host tried with its answer; transient when
    one of them may serve it later."""
    if not tried:
        return TransientError(
            f"model file {redact_url(uri)}: no host tried within {deadline_s:g}s",
            kind="deadline_exceeded",
        )
    if len(tried) == 1:
        return tried[0][1]
    answers = "; ".join(f"{redact_url(where)}: {error}" for where, error in tried)
    message = f"model file {redact_url(uri)}: none of its {len(tried)} hosts served it ({answers})"
    transient = [error for _where, error in tried if error.retryable]
    if transient:
        return TransientError(message, kind=transient[-1].kind)
    return PermanentError(message, kind=tried[-1][1].kind)


def _larger(error: WorkerError) -> str:
    """The size an over-cap answer declared ("is N bytes, over M"), else "more than M"."""
    text = str(error)
    if " is " in text and " bytes, over " in text:
        return text.rpartition(" is ")[2].partition(" bytes")[0]
    return "more than " + text.rpartition(" over ")[2].partition(" bytes")[0]


def _file_name(uri: str) -> str:
    """The file's name as the operator may name it in WORKER_MODEL__FILE_DIGESTS (or by its
    whole URI): the last part of its path (of its key, for s3://)."""
    if uri.startswith("s3://"):
        return uri.rpartition("/")[2]
    return urlsplit(uri).path.rstrip("/").rpartition("/")[2]


def _fits(wanted: Wanted, record: Record) -> bool:
    return wanted.fits(record.sha256) and wanted.sized(record.size_bytes)


def _changed(store: Store, key: str, uri: str, record: Record) -> None:
    """Say so when the cached file is there but is no longer what was recorded."""
    found = store.cached_sha256(key)
    if found is not None and found != record.sha256:
        log.warning(
            "model_file_changed_in_cache",
            uri=redact_url(uri),
            recorded_sha256=record.sha256,
            found_sha256=found,
        )


def _hit(store: Store, uri: str, wanted: Wanted, keep: bool) -> tuple[Fetched, bytes] | None:
    """The cached file when its record fits ``wanted`` and its sha256 is the recorded one."""
    key = store.key(uri)
    record = store.record(key)
    if record is None or not _fits(wanted, record):
        return None
    found = _on_disk(store.path(key), keep)
    if found is None or found[0] != record.sha256:
        return None
    path, pinned = store.path(key), wanted.pinned(True)
    return Fetched(redact_url(uri), path, found[0], record.size_bytes, pinned, False), found[1]


def _checked(uri: str, data: bytes, wanted: Wanted, pin: str | None) -> str:
    """``data``'s sha256 when it is what was declared (or recorded); refused otherwise."""
    if not wanted.sized(len(data)):
        assert wanted.size_bytes is not None
        raise size_refusal(uri, wanted.size_bytes, str(len(data)))
    sha256 = _sha256(data)
    if not wanted.fits(sha256):
        what = "sha256" if wanted.full else "sha256 prefix"
        raise refusal(uri, wanted.hex, sha256, f"its {what} is not the one declared")
    if pin is not None and sha256 != pin:
        raise refusal(uri, pin, sha256, "its content changed since its first download")
    return sha256


def _local(uri: str, wanted: Wanted, keep: bool) -> tuple[Fetched, bytes]:
    path = Path(uri.removeprefix("file://"))  # as_uri does not quote
    try:
        data = path.read_bytes() if keep else b""
        sha256 = _sha256(data) if keep else file_sha256(path)
        size = len(data) if keep else path.stat().st_size
    except FileNotFoundError:
        raise PermanentError(f"{path} does not exist", kind="object_missing") from None
    except OSError as error:
        raise PermanentError(f"cannot read {path}: {error}", kind="unreadable") from None
    if not wanted.sized(size):
        assert wanted.size_bytes is not None
        raise size_refusal(str(path), wanted.size_bytes, str(size))
    if not wanted.fits(sha256):
        raise refusal(str(path), wanted.hex, sha256, "its sha256 is not the one declared")
    return Fetched(str(path), path, sha256, size, wanted.pinned(False), False), data


def _on_disk(path: Path, keep: bool) -> tuple[str, bytes] | None:
    """(sha256, the bytes when ``keep``) of the cached file, or None when there is none."""
    try:
        if keep:
            data = path.read_bytes()
            return _sha256(data), data
        return file_sha256(path), b""
    except FileNotFoundError:
        return None


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _insecure(uri: str, wanted: Wanted) -> ConfigError | None:
    """The refusal of plain http:// to another host without the full sha256 declared."""
    if urlsplit(uri).scheme != "http" or wanted.full or loopback_url(uri):
        return None
    return ConfigError(
        f"model file {redact_url(uri)}: http:// only to this host, or with the full "
        "sha256 declared; use https://"
    )
