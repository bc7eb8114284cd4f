"""Image bytes from s3://, http(s):// and file:// URIs, under the source policy.

Task URIs come from strangers (``read_bytes``): ``file://`` only under the configured roots,
http(s) never to private addresses unless allowed (see ``datasets.httpget``), every read
capped at ``max_bytes`` while reading and bounded by one deadline per object. The operator's
own URIs (weights, labels) are read by ``read_trusted``, without the policy.

One boto3 client per process, made lazily and keyed by pid, so a loader worker never uses a
client created in its parent.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from config.errors import PermanentError, TransientError
from config.redact import redact_url
from datasets.deadline import Cutoff
from datasets.httpget import HttpPolicy, allowed_entry, read_http

_MISSING_CODES = {"NoSuchKey", "NoSuchBucket", "404", "NotFound"}
_DENIED_CODES = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"}
MAX_IMAGE_BYTES = 64 * 1024 * 1024
_CHUNK_BYTES = 1024 * 1024


@dataclass(frozen=True)
class SourceConfig:
    """What a loader process needs to reach image sources; picklable."""

    s3_endpoint_url: str | None = None
    s3_region: str = "us-east-1"
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 20.0
    max_attempts: int = 3
    http_timeout_s: float = 20.0
    file_roots: tuple[str, ...] = ()  # empty: file:// refused
    allowed_hosts: frozenset[str] = frozenset()  # host or host:port allowed private addresses
    max_bytes: int = MAX_IMAGE_BYTES
    object_deadline_s: float = 30.0
    max_redirects: int = 5

    def http_policy(self) -> HttpPolicy:
        allowed = {allowed_entry(entry) for entry in self.allowed_hosts}
        if self.s3_endpoint_url:
            # Presigned URLs to a private S3 endpoint: that host and port, nothing else on it.
            endpoint = urlsplit(self.s3_endpoint_url)
            if endpoint.hostname:
                default_port = 443 if endpoint.scheme == "https" else 80
                allowed.add((endpoint.hostname.lower(), endpoint.port or default_port))
        return HttpPolicy(
            allowed=frozenset(allowed),
            max_bytes=self.max_bytes,
            deadline_s=self.object_deadline_s,
            connect_timeout_s=min(self.connect_timeout_s, self.http_timeout_s),
            read_timeout_s=self.http_timeout_s,
            max_redirects=self.max_redirects,
        )


_clients: dict[tuple[int, SourceConfig], Any] = {}


def s3_client(config: SourceConfig) -> Any:
    """This process's S3 client for ``config``, created on first use."""
    key = (os.getpid(), config)
    client = _clients.get(key)
    if client is None:
        import boto3
        from botocore.config import Config

        client = boto3.session.Session().client(
            "s3",
            endpoint_url=config.s3_endpoint_url,
            region_name=config.s3_region,
            config=Config(
                connect_timeout=config.connect_timeout_s,
                read_timeout=config.read_timeout_s,
                retries={"max_attempts": config.max_attempts, "mode": "standard"},
            ),
        )
        _clients[key] = client
    return client


def split_s3_uri(uri: str) -> tuple[str, str]:
    parsed = urlsplit(uri)
    bucket, key = parsed.netloc, parsed.path.lstrip("/")
    if not bucket or not key:
        raise PermanentError(f"{redact_url(uri)!r} is not s3://bucket/key", kind="invalid_uri")
    return bucket, key


def read_bytes(uri: str, config: SourceConfig) -> bytes:
    """A task's object: its bytes, or PermanentError / TransientError saying why not."""
    scheme = urlsplit(uri).scheme
    if scheme == "s3":
        return _read_s3(uri, config, config.max_bytes)
    if scheme in ("http", "https"):
        return read_http(uri, config.http_policy())
    if scheme == "file":
        return _read_file(uri, config)
    raise PermanentError(f"unsupported URI scheme {scheme!r}", kind="invalid_uri")


def read_trusted(uri: str, config: SourceConfig) -> bytes:
    """The operator's own object (weights, labels): s3:// or a local file, no source policy."""
    if uri.startswith("s3://"):
        return _read_s3(uri, config, max_bytes=None)
    path = Path(uri.removeprefix("file://"))
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise PermanentError(f"{path} does not exist", kind="object_missing") from None
    except OSError as error:
        raise PermanentError(f"cannot read {path}: {error}", kind="unreadable") from None


def _read_s3(uri: str, config: SourceConfig, max_bytes: int | None) -> bytes:
    from botocore.exceptions import BotoCoreError, ClientError, ParamValidationError

    bucket, key = split_s3_uri(uri)
    shown = redact_url(uri)
    try:
        with Cutoff(config.object_deadline_s) as cutoff:
            response = s3_client(config).get_object(Bucket=bucket, Key=key)
            size = int(response.get("ContentLength") or 0)
            body = response["Body"]
            if max_bytes is not None and size > max_bytes:
                body.close()
                raise PermanentError(f"{shown} is {size} bytes, over {max_bytes}", kind="too_large")
            cutoff.watch(body_socket(body))
            return _read_capped(body, shown, max_bytes, cutoff)
    except ParamValidationError as error:
        raise PermanentError(f"invalid S3 location {shown}: {error}", kind="invalid_uri") from None
    except ClientError as error:
        code = str(error.response.get("Error", {}).get("Code", ""))
        status = int(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        if code in _MISSING_CODES:
            raise PermanentError(
                f"{shown} does not exist ({code})", kind="object_missing"
            ) from None
        if code in _DENIED_CODES:
            raise PermanentError(f"{shown}: access denied ({code})", kind="access_denied") from None
        if status >= 500 or code in ("SlowDown", "Throttling", "RequestTimeout"):
            raise TransientError(
                f"S3 answered {status} {code} for {shown}", kind="s3_unavailable"
            ) from None
        raise PermanentError(f"S3 refused {shown}: {status} {code}", kind="s3_error") from None
    except BotoCoreError as error:
        raise TransientError(
            f"S3 unreachable for {shown}: {type(error).__name__}", kind="s3_unavailable"
        ) from None


def _read_capped(body: Any, shown: str, max_bytes: int | None, cutoff: Cutoff) -> bytes:
    chunks: list[bytes] = []
    total = 0
    try:
        while chunk := body.read(_CHUNK_BYTES):
            total += len(chunk)
            if max_bytes is not None and total > max_bytes:
                raise PermanentError(f"{shown} is over {max_bytes} bytes", kind="too_large")
            if cutoff.expired():
                break
            chunks.append(chunk)
    except (OSError, ValueError) as error:
        if not cutoff.expired():
            raise TransientError(
                f"S3 read failed for {shown}: {type(error).__name__}", kind="s3_unavailable"
            ) from None
    finally:
        body.close()
    if cutoff.expired():
        raise TransientError(
            f"{shown}: no whole object within the object deadline", kind="deadline_exceeded"
        )
    return b"".join(chunks)


def body_socket(body: Any) -> Any:
    """The socket under a botocore StreamingBody, or None if the layout has moved.

    The one place that reaches into botocore and urllib3 internals; botocore's own
    ``set_socket_timeout`` walks the same path. Without it the deadline is checked between
    reads only (each read is still bounded by WORKER_S3__READ_TIMEOUT_S).
    """
    try:
        return body._raw_stream._fp.fp.raw._sock
    except AttributeError:
        return None


def _read_file(uri: str, config: SourceConfig) -> bytes:
    parts = urlsplit(uri)
    shown = redact_url(uri)
    if not config.file_roots:
        raise PermanentError(
            f"{shown}: file:// is off (WORKER_SOURCES__FILE_ROOTS is empty)", kind="file_refused"
        )
    if parts.netloc not in ("", "localhost"):
        raise PermanentError(f"{shown}: file:// on another host is refused", kind="file_refused")
    try:
        path = os.path.realpath(unquote(parts.path))
        roots = _roots(config)
        if not any(_inside(path, root) for root in roots):
            raise PermanentError(
                f"{shown}: not under WORKER_SOURCES__FILE_ROOTS", kind="file_refused"
            )
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        opened = os.readlink(f"/proc/self/fd/{fd}")  # what was opened, after any swap
        if not any(_inside(opened, root) for root in roots):
            os.close(fd)
            raise PermanentError(
                f"{shown}: not under WORKER_SOURCES__FILE_ROOTS", kind="file_refused"
            )
    except FileNotFoundError:
        raise PermanentError(f"{shown} does not exist", kind="object_missing") from None
    except (OSError, ValueError) as error:
        raise PermanentError(
            f"cannot read {shown}: {type(error).__name__}", kind="unreadable"
        ) from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise PermanentError(f"{shown} is not a regular file", kind="file_refused")
        if info.st_size > config.max_bytes:
            raise PermanentError(
                f"{shown} is {info.st_size} bytes, over {config.max_bytes}", kind="too_large"
            )
        data = file.read(config.max_bytes + 1)
    if len(data) > config.max_bytes:
        raise PermanentError(f"{shown} is over {config.max_bytes} bytes", kind="too_large")
    return data


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _roots(config: SourceConfig) -> list[str]:
    return [os.path.realpath(root) for root in config.file_roots]
