"""Image bytes from s3://, http(s):// and file:// URIs, under the source policy.

Task URIs come from strangers (``read_bytes``): ``file://`` only under the configured roots,
http(s) never to private addresses unless allowed (see ``datasets.httpget``), every read
capped at ``max_bytes`` while reading and bounded by one deadline per object. The operator's
own URIs (weights, labels) are read by ``read_trusted``, without the policy.

One boto3 client per process, made lazily and keyed by pid, so a loader worker never uses a
client created in its parent; its threads share it (boto3 clients are thread-safe), with a
connection pool as large as the reads it keeps in flight.

S3 and http(s) reads retry by themselves, within the object's deadline and ``max_attempts``:
a read that produced no byte for its stall time (``read_timeout_s`` for S3, ``http_timeout_s``
for http(s); first byte or body) is abandoned and made again on a new connection at once,
since a tail of slow requests must not set the pace; throttling (429, 503 SlowDown) and
server errors back off with full jitter first. botocore's own retries are off, so an attempt
is an attempt. The object's deadline bounds an S3 GET whole, its answer's headers included
(``datasets.s3_sockets``), as it bounds an http(s) exchange.
"""

from __future__ import annotations

import os
import random
import stat
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from config.errors import PermanentError, RetryableRead, TransientError, WorkerError
from config.names import env_name
from config.redact import redact_url
from datasets.budget import Admit, Reading
from datasets.deadline import Cutoff
from datasets.httpget import HttpPolicy, allowed_entry, read_http
from datasets.s3_sockets import watch_requests, watching

_MISSING_CODES = {"NoSuchKey", "NoSuchBucket", "404", "NotFound"}
_DENIED_CODES = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"}
MAX_IMAGE_BYTES = 64 * 1024 * 1024
_THROTTLED_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded"}
_CHUNK_BYTES = 1024 * 1024
_BACKOFF_BASE_S = {"throttled": 0.2, "unavailable": 0.05}
_BACKOFF_MAX_S = 5.0
_FILE_ROOTS = env_name("sources", "file_roots")


@dataclass(frozen=True)
class SourceConfig:
    """What a loader process needs to reach image sources; picklable."""

    s3_endpoint_url: str | None = None
    s3_region: str = "us-east-1"
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 5.0
    max_attempts: int = 3
    http_timeout_s: float = 5.0
    file_roots: tuple[str, ...] = ()  # empty: file:// refused
    allowed_hosts: frozenset[str] = frozenset()  # host or host:port allowed private addresses
    max_bytes: int = MAX_IMAGE_BYTES
    object_deadline_s: float = 30.0
    max_redirects: int = 5
    reads_in_flight: int = 1  # per loader child: reads it keeps going at once
    read_bytes_in_flight: int = 128 * 1024 * 1024  # per loader child: encoded bytes it holds

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
            keep_alive=max(1, self.reads_in_flight),  # one idle per read this child may make
        )


_clients: dict[tuple[int, SourceConfig], Any] = {}
_clients_lock = threading.Lock()


def _fresh_lock_in_child() -> None:
    global _clients_lock
    _clients_lock = threading.Lock()  # a fork may have copied it held by another thread


os.register_at_fork(after_in_child=_fresh_lock_in_child)


def s3_client(config: SourceConfig) -> Any:
    """This process's S3 client for ``config``, created on first use, shared by its threads."""
    key = (os.getpid(), config)
    with _clients_lock:
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
                    retries={"total_max_attempts": 1},  # ours: see _read_s3
                    max_pool_connections=max(10, config.reads_in_flight + 2),
                ),
            )
            watch_requests(client)  # one deadline from the request on (``_s3_attempt``)
            _clients[key] = client
    return client


def split_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/key`` to (bucket, key). The key is everything after the bucket's slash,
    taken as it is: S3 keys may hold ``#``, ``?`` and ``%``, which a URL parser would cut off
    as a fragment or query (or decode), reading another object."""
    if not uri.startswith("s3://"):
        raise PermanentError(f"{redact_url(uri)!r} is not s3://bucket/key", kind="invalid_uri")
    bucket, _, key = uri[len("s3://") :].partition("/")
    if not bucket or not key:
        raise PermanentError(f"{redact_url(uri)!r} is not s3://bucket/key", kind="invalid_uri")
    return bucket, key


def read_bytes(uri: str, config: SourceConfig, reading: Reading | None = None) -> bytes:
    """A task's object: its bytes, or PermanentError / TransientError saying why not."""
    reading = reading or Reading()
    scheme = urlsplit(uri).scheme
    if scheme == "s3":
        return _read_s3(uri, config, config.max_bytes, reading)
    if scheme in ("http", "https"):
        return _read_http(uri, config, reading)
    if scheme == "file":
        return _read_file(uri, config, reading.admit)
    raise PermanentError(f"unsupported URI scheme {scheme!r}", kind="invalid_uri")


def read_trusted(uri: str, config: SourceConfig) -> bytes:
    """The operator's own object (weights, labels): s3:// or a local file, no source policy."""
    if uri.startswith("s3://"):
        return _read_s3(uri, config, None, Reading())
    path = Path(uri.removeprefix("file://"))
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise PermanentError(f"{path} does not exist", kind="object_missing") from None
    except OSError as error:
        raise PermanentError(f"cannot read {path}: {error}", kind="unreadable") from None


def _read_s3(uri: str, config: SourceConfig, max_bytes: int | None, reading: Reading) -> bytes:
    bucket, key = split_s3_uri(uri)
    shown = redact_url(uri)
    return _with_retries(
        lambda cutoff: _s3_attempt(bucket, key, shown, config, max_bytes, reading, cutoff),
        config,
        reading,
        shown,
        attempt_s=config.connect_timeout_s + config.read_timeout_s,
    )


def _read_http(uri: str, config: SourceConfig, reading: Reading) -> bytes:
    policy = config.http_policy()
    return _with_retries(
        lambda cutoff: read_http(uri, policy, reading.admit, cutoff),
        config,
        reading,
        redact_url(uri),
        attempt_s=policy.connect_timeout_s + policy.read_timeout_s,
    )


def _with_retries(
    attempt: Callable[[Cutoff], bytes],
    config: SourceConfig,
    reading: Reading,
    shown: str,
    attempt_s: float,
) -> bytes:
    """``attempt`` until one succeeds, within ``max_attempts`` and one deadline for them all.
    An attempt may wait ``attempt_s`` (connect + stall time) before its first byte, where the
    deadline does not reach yet: another is started only if it fits."""
    with Cutoff(config.object_deadline_s) as cutoff:
        for n in range(1, config.max_attempts + 1):
            try:
                return attempt(cutoff)
            except RetryableRead as retry:
                if cutoff.expired():
                    break
                pause_s = backoff_s(retry.reason, n)
                if n == config.max_attempts or pause_s + attempt_s > cutoff.remaining_s():
                    raise
                reading.retries.append(retry.reason)
                time.sleep(pause_s)
    raise _past_deadline(shown)


def backoff_s(reason: str, attempt: int) -> float:
    """Pause before the next attempt: none after a stall (a new connection is the cure), full
    jitter after throttling (503, SlowDown) or another server error."""
    base_s = _BACKOFF_BASE_S.get(reason, 0.0)
    return random.uniform(0, min(_BACKOFF_MAX_S, base_s * 2 ** (attempt - 1)))


def _s3_attempt(
    bucket: str,
    key: str,
    shown: str,
    config: SourceConfig,
    max_bytes: int | None,
    reading: Reading,
    cutoff: Cutoff,
) -> bytes:
    """One GET of the object, its errors sorted: permanent, worth another attempt
    (``RetryableRead``), or transient."""
    from botocore import exceptions as boto

    try:
        with watching(cutoff):  # the answer's headers too, not only its body
            response = s3_client(config).get_object(Bucket=bucket, Key=key)
            return _s3_body(response, shown, max_bytes, reading, cutoff)
    except boto.ParamValidationError as error:
        raise PermanentError(f"invalid S3 location {shown}: {error}", kind="invalid_uri") from None
    except boto.ClientError as error:
        raise _s3_answered(error.response, shown) from None
    except (boto.ReadTimeoutError, boto.ConnectTimeoutError) as error:
        waited = "no connection" if isinstance(error, boto.ConnectTimeoutError) else "no byte"
        raise RetryableRead(
            f"S3: {waited} in time for {shown}", kind="s3_unavailable", reason="stalled"
        ) from None
    except (
        boto.EndpointConnectionError,
        boto.ConnectionClosedError,
        boto.IncompleteReadError,
        boto.ResponseStreamingError,
        OSError,
        ValueError,
    ) as error:
        if cutoff.expired():
            raise _past_deadline(shown) from None
        raise RetryableRead(
            f"S3 unreachable for {shown}: {type(error).__name__}",
            kind="s3_unavailable",
            reason="unavailable",
        ) from None
    except boto.BotoCoreError as error:  # credentials, configuration: another attempt will not help
        if cutoff.expired():  # a cut socket may read as any error of the answer
            raise _past_deadline(shown) from None
        raise TransientError(
            f"S3 client error for {shown}: {type(error).__name__}", kind="s3_unavailable"
        ) from None


def _s3_body(
    response: Mapping[str, Any], shown: str, max_bytes: int | None, reading: Reading, cutoff: Cutoff
) -> bytes:
    """A GET's body: its size checked and admitted before it is read."""
    declared = response.get("ContentLength")
    size = int(declared) if declared is not None else (max_bytes or 0)
    body = response["Body"]
    try:
        if max_bytes is not None and size > max_bytes:
            raise PermanentError(f"{shown} is {size} bytes, over {max_bytes}", kind="too_large")
        reading.admit(size, cutoff.remaining_s())
        cutoff.watch(body_socket(body))
        return _read_capped(body, shown, max_bytes, cutoff)
    finally:
        body.close()  # unread: the connection is dropped, a retry gets a new one


def _s3_answered(response: Mapping[str, Any], shown: str) -> WorkerError:
    """What an S3 error answer means: missing, denied, worth another attempt, or refused."""
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    if code in _MISSING_CODES:
        return PermanentError(f"{shown} does not exist ({code})", kind="object_missing")
    if code in _DENIED_CODES:
        return PermanentError(f"{shown}: access denied ({code})", kind="access_denied")
    if status >= 500 or code in _THROTTLED_CODES or code == "RequestTimeout":
        reason = "throttled" if code in _THROTTLED_CODES or status == 503 else "unavailable"
        return RetryableRead(
            f"S3 answered {status} {code} for {shown}", kind="s3_unavailable", reason=reason
        )
    return PermanentError(f"S3 refused {shown}: {status} {code}", kind="s3_error")


def _past_deadline(shown: str) -> TransientError:
    return TransientError(
        f"{shown}: no whole object within the object deadline", kind="deadline_exceeded"
    )


def _read_capped(body: Any, shown: str, max_bytes: int | None, cutoff: Cutoff) -> bytes:
    """The body, read in chunks and capped; its errors are the caller's to sort."""
    chunks: list[bytes] = []
    total = 0
    while chunk := body.read(_CHUNK_BYTES):
        total += len(chunk)
        if max_bytes is not None and total > max_bytes:
            raise PermanentError(f"{shown} is over {max_bytes} bytes", kind="too_large")
        if cutoff.expired():
            break
        chunks.append(chunk)
    if cutoff.expired():
        raise _past_deadline(shown)
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


def _read_file(uri: str, config: SourceConfig, admit: Admit) -> bytes:
    parts = urlsplit(uri)
    shown = redact_url(uri)
    if not config.file_roots:
        raise PermanentError(
            f"{shown}: file:// is off ({_FILE_ROOTS} is empty)", kind="file_refused"
        )
    if parts.netloc not in ("", "localhost"):
        raise PermanentError(f"{shown}: file:// on another host is refused", kind="file_refused")
    try:
        path = os.path.realpath(unquote(parts.path))
        roots = _roots(config)
        if not any(_inside(path, root) for root in roots):
            raise PermanentError(f"{shown}: not under {_FILE_ROOTS}", kind="file_refused")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        opened = os.readlink(f"/proc/self/fd/{fd}")  # what was opened, after any swap
        if not any(_inside(opened, root) for root in roots):
            os.close(fd)
            raise PermanentError(f"{shown}: not under {_FILE_ROOTS}", kind="file_refused")
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
        admit(info.st_size, config.object_deadline_s)
        data = file.read(config.max_bytes + 1)
    if len(data) > config.max_bytes:
        raise PermanentError(f"{shown} is over {config.max_bytes} bytes", kind="too_large")
    return data


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _roots(config: SourceConfig) -> list[str]:
    return [os.path.realpath(root) for root in config.file_roots]
