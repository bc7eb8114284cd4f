"""Model files by URI, checked and cached: ``ModelFiles`` reads weights and labels.

- A path (or ``file://``): read as it is, its declared digest checked; nothing cached.
- ``https://``, ``s3://`` (and ``http://`` to a loopback host, or with the full sha256
  declared): downloaded once per host into the cache directory (``store.Store``) under a lock,
  so processes of the host starting together download once; used from there with no network
  while its content fits what is declared or was recorded.
- Downloads: capped at ``max_bytes`` while reading, one deadline for all attempts
  (``datasets.uris``: connect and stall timeouts, retries), redirects only to the same
  scheme. A file whose sha256 is not the one declared, or not the one recorded for its URI at
  its first download, is refused (both digests in the message) and nothing of it is kept.
"""

from __future__ import annotations

import hashlib
import ipaddress
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

import structlog

from config.errors import ConfigError, PermanentError
from config.redact import redact_url
from datasets.uris import SourceConfig, read_bytes
from pipelines.files.digest import Pinned, Wanted, refusal
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


class ModelFiles:
    """Reads model files; ``cache_dir`` None: remote files are read into memory each time
    (digests still checked), for tests and benchmarks that load a model in process."""

    def __init__(
        self,
        sources: SourceConfig,
        cache_dir: Path | None = None,
        max_bytes: int = MAX_FILE_BYTES,
        deadline_s: float = 600.0,
    ) -> None:
        self._sources = sources
        self._store = Store(cache_dir) if cache_dir is not None else None
        self.max_bytes = max_bytes
        self.deadline_s = deadline_s

    def read(self, uri: str, digest: str | None = None) -> bytes:
        """The file's bytes, checked against ``digest`` (a sha256 or a prefix of one)."""
        return self._get(uri, digest, keep=True)[1]

    def fetch(self, uri: str, digest: str | None = None) -> Fetched:
        """The file cached (downloaded when it is not) and checked; its bytes not kept."""
        return self._get(uri, digest, keep=False)[0]

    def status(self, uri: str, digest: str | None = None) -> tuple[Pinned, bool]:
        """How the file is pinned and whether it is in the cache now; nothing downloaded.
        ConfigError when it would be refused before any download (plain http:// elsewhere)."""
        wanted = Wanted.parse(digest, uri)
        refused = _insecure(uri, wanted)
        if refused is not None:
            raise refused
        if not is_remote(uri) or self._store is None:
            return wanted.pinned(False), False
        key = self._store.key(uri)
        record = self._store.record(key)
        cached = record is not None and wanted.fits(record.sha256)
        cached = cached and self._store.path(key).is_file()
        return wanted.pinned(True), cached

    def _get(self, uri: str, digest: str | None, keep: bool) -> tuple[Fetched, bytes]:
        wanted = Wanted.parse(digest, uri)
        scheme = urlsplit(uri).scheme
        if scheme in ("", "file"):
            return _local(uri, wanted, keep)
        refused = _insecure(uri, wanted)
        if refused is not None:
            raise refused
        if not is_remote(uri):
            raise ConfigError(f"model file {redact_url(uri)}: give a path, https:// or s3:// URI")
        if self._store is None:
            data = self._download(uri)
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
            store.drop(key)  # missing or damaged: downloaded again, against the same pin
        # The recorded sha256 holds unless a full one is declared, or a new prefix it misses.
        held = record is not None and not wanted.full and wanted.fits(record.sha256)
        pin = record.sha256 if held and record is not None else None
        data = self._download(uri)
        sha256 = _checked(uri, data, wanted, pin)
        pinned = wanted.pinned(True)
        path = store.put(key, uri, data, Record(sha256, len(data), pinned))
        log.info(
            "model_file_downloaded",
            uri=redact_url(uri),
            sha256=sha256,
            bytes=len(data),
            pinned=pinned,
        )
        fetched = Fetched(redact_url(uri), path, sha256, len(data), pinned, True)
        return fetched, data if keep else b""

    def _download(self, uri: str) -> bytes:
        """The remote file's bytes: the source rules of ``datasets.uris`` with this
        cache's size cap and deadline; the URI's own host may be a private address (the
        operator named it)."""
        config = replace(
            self._sources,
            max_bytes=self.max_bytes,
            object_deadline_s=self.deadline_s,
            file_roots=(),
            reads_in_flight=1,
        )
        if urlsplit(uri).scheme != "s3":
            host = urlsplit(uri).netloc.rpartition("@")[2]
            config = replace(config, allowed_hosts=frozenset({host}))
        return read_bytes(uri, config)


def _hit(store: Store, uri: str, wanted: Wanted, keep: bool) -> tuple[Fetched, bytes] | None:
    """The cached file when its record fits ``wanted`` and its sha256 is the recorded one."""
    key = store.key(uri)
    record = store.record(key)
    if record is None or not wanted.fits(record.sha256):
        return None
    found = _on_disk(store.path(key), keep)
    if found is None or found[0] != record.sha256:
        return None
    path, pinned = store.path(key), wanted.pinned(True)
    return Fetched(redact_url(uri), path, found[0], record.size_bytes, pinned, False), found[1]


def _checked(uri: str, data: bytes, wanted: Wanted, pin: str | None) -> str:
    """``data``'s sha256 when it is what was declared (or recorded); refused otherwise."""
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
    if urlsplit(uri).scheme != "http" or wanted.full or _loopback(uri):
        return None
    return ConfigError(
        f"model file {redact_url(uri)}: http:// only to this host, or with the full "
        "sha256 declared; use https://"
    )


def _loopback(uri: str) -> bool:
    host = (urlsplit(uri).hostname or "").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
