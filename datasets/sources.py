"""Image bytes from s3://, http(s):// and file:// URIs.

One boto3 client per process, made lazily and keyed by pid, so a loader worker never uses a
client created in its parent.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from datasets.errors import PermanentError, TransientError

_MISSING_CODES = {"NoSuchKey", "NoSuchBucket", "404", "NotFound"}
_DENIED_CODES = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"}
MAX_IMAGE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class SourceConfig:
    """What a loader process needs to reach image sources; picklable."""

    s3_endpoint_url: str | None = None
    s3_region: str = "us-east-1"
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 20.0
    max_attempts: int = 3
    http_timeout_s: float = 20.0


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
    parsed = urlparse(uri)
    bucket, key = parsed.netloc, parsed.path.lstrip("/")
    if not bucket or not key:
        raise PermanentError(f"{uri!r} is not s3://bucket/key", kind="invalid_uri")
    return bucket, key


def read_bytes(uri: str, config: SourceConfig) -> bytes:
    """The object's bytes, or PermanentError / TransientError saying why not."""
    scheme = urlparse(uri).scheme
    if scheme == "s3":
        return _read_s3(uri, config)
    if scheme in ("http", "https"):
        return _read_http(uri, config)
    if scheme == "file":
        return _read_file(uri)
    raise PermanentError(f"unsupported URI scheme {scheme!r} in {uri!r}", kind="invalid_uri")


def _read_s3(uri: str, config: SourceConfig) -> bytes:
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = split_s3_uri(uri)
    try:
        response = s3_client(config).get_object(Bucket=bucket, Key=key)
        size = int(response.get("ContentLength") or 0)
        if size > MAX_IMAGE_BYTES:
            response["Body"].close()
            raise PermanentError(f"{uri} is {size} bytes, over {MAX_IMAGE_BYTES}", kind="too_large")
        body: bytes = response["Body"].read()
        return body
    except ClientError as error:
        code = str(error.response.get("Error", {}).get("Code", ""))
        status = int(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        if code in _MISSING_CODES:
            raise PermanentError(f"{uri} does not exist ({code})", kind="object_missing") from None
        if code in _DENIED_CODES:
            raise PermanentError(f"{uri}: access denied ({code})", kind="access_denied") from None
        if status >= 500 or code in ("SlowDown", "Throttling", "RequestTimeout"):
            raise TransientError(
                f"S3 answered {status} {code} for {uri}", kind="s3_unavailable"
            ) from None
        raise PermanentError(f"S3 refused {uri}: {status} {code}", kind="s3_error") from None
    except BotoCoreError as error:
        raise TransientError(f"S3 unreachable for {uri}: {error}", kind="s3_unavailable") from None


def _read_http(uri: str, config: SourceConfig) -> bytes:
    try:
        with urllib.request.urlopen(uri, timeout=config.http_timeout_s) as response:
            body: bytes = response.read(MAX_IMAGE_BYTES + 1)
    except urllib.error.HTTPError as error:
        if error.code >= 500 or error.code == 429:
            raise TransientError(f"HTTP {error.code} for {uri}", kind="http_unavailable") from None
        kind = "object_missing" if error.code in (404, 410) else "http_error"
        raise PermanentError(f"HTTP {error.code} for {uri}", kind=kind) from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as error:
        raise TransientError(f"cannot reach {uri}: {error}", kind="http_unavailable") from None
    if len(body) > MAX_IMAGE_BYTES:
        raise PermanentError(f"{uri} is over {MAX_IMAGE_BYTES} bytes", kind="too_large")
    return body


def _read_file(uri: str) -> bytes:
    path = Path(unquote(urlparse(uri).path))
    try:
        if path.stat().st_size > MAX_IMAGE_BYTES:
            raise PermanentError(f"{uri} is over {MAX_IMAGE_BYTES} bytes", kind="too_large")
        return path.read_bytes()
    except FileNotFoundError:
        raise PermanentError(f"{uri} does not exist", kind="object_missing") from None
    except (IsADirectoryError, PermissionError) as error:
        raise PermanentError(f"cannot read {uri}: {error}", kind="unreadable") from None
