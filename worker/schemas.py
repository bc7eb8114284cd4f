"""Task and result messages (the SPEC's schemas) and subject tokens. Imports nothing of ours
but the redaction helper.

Everything in a task is untrusted until it passes ``parse_task``: ids are capped and checked
here, once, before they reach a subject, a header, a file system, a socket or a log line.

Which ids name the same task: ids compare as exact strings, after an integer id is written
in decimal (``17`` and ``"17"`` are one task; ``" 17"`` is another).
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass, field
from typing import Any

from config.errors import Failure, InvalidTask, Undeliverable
from config.redact import redact_url, shorten

_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,128}")
_ENCODED_PREFIX = "b64-"
URI_SCHEMES = ("s3://", "http://", "https://", "file://")
MAX_ID_BYTES = 256  # task id and job id, UTF-8; longer ids are dead-lettered
MAX_IMAGE_ID_BYTES = 1024
MAX_URL_CHARS = 8192


def subject_token(value: str) -> str:
    """``value`` as one NATS subject token; injective, readable when already safe.

    Tokens never contain ``.``, so subjects joined from tokens are injective too. ``value``
    must be valid Unicode (``parse_task`` guarantees it for task and job ids).
    """
    if _TOKEN.fullmatch(value) and not value.startswith(_ENCODED_PREFIX):
        return value
    encoded = base64.urlsafe_b64encode(value.encode("utf-8")).decode("ascii").rstrip("=")
    return _ENCODED_PREFIX + encoded


@dataclass(frozen=True)
class Task:
    id: str
    job_id: str
    image_id: str
    image_url: str
    config: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "job_id": self.job_id,
            "image_id": self.image_id,
            "image_url": self.image_url,
            "config": self.config,
        }


@dataclass(frozen=True)
class Verdict:
    """What became of a task's work: predictions, or the failure that stopped it."""

    predictions: list[dict[str, Any]] | None = None
    failure: Failure | None = None
    timings_s: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.failure is None

    @property
    def retryable(self) -> bool:
        return self.failure is not None and self.failure.retryable


def _id_text(value: Any, max_bytes: int) -> tuple[str | None, str]:
    """``value`` as an id string, or None and why not."""
    if isinstance(value, int) and not isinstance(value, bool):
        if abs(value) >= 10 ** (max_bytes - 1):
            return None, f"an integer of more than {max_bytes - 1} digits"
        value = str(value)
    if not isinstance(value, str) or not value:
        return None, "missing, empty, or neither a string nor an integer"
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        return None, "not valid Unicode (a lone surrogate)"
    if size > max_bytes:
        return None, f"{size} bytes long, over the cap of {max_bytes}"
    return value, ""


def _decode_json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except RecursionError:
        raise Undeliverable("not JSON this worker accepts: nested too deeply") from None
    except (ValueError, TypeError) as error:  # JSONDecodeError, UnicodeDecodeError, huge ints
        raise Undeliverable(f"not JSON: {shorten(str(error), 200)}") from None


def parse_task(data: bytes) -> Task:
    """The task in ``data``; Undeliverable when it cannot name its job and task, InvalidTask
    when it can but cannot be run. Never raises anything else, whatever ``data`` holds."""
    payload = _decode_json(data)
    if not isinstance(payload, dict):
        raise Undeliverable(f"expected a JSON object, got {type(payload).__name__}")
    task_id, why_task = _id_text(payload.get("id"), MAX_ID_BYTES)
    job_id, why_job = _id_text(payload.get("job_id"), MAX_ID_BYTES)
    if task_id is None:
        raise Undeliverable(f"'id' is unusable: {why_task}")
    if job_id is None:
        raise Undeliverable(f"'job_id' is unusable: {why_job}")
    image_id, why_image = _id_text(payload.get("image_id"), MAX_IMAGE_ID_BYTES)

    def invalid(reason: str) -> InvalidTask:
        return InvalidTask(reason, task_id=task_id, job_id=job_id, image_id=image_id or "")

    if image_id is None:
        raise invalid(f"'image_id' is unusable: {why_image}")
    url = payload.get("image_url")
    if not isinstance(url, str):
        raise invalid(f"'image_url' must be a string URI, got {type(url).__name__}")
    if len(url) > MAX_URL_CHARS:
        raise invalid(f"'image_url' is {len(url)} characters long, over {MAX_URL_CHARS}")
    if (
        not url.startswith(URI_SCHEMES)
        or _id_text(url, 4 * MAX_URL_CHARS)[0] is None
        or any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in url)
    ):
        raise invalid(
            f"'image_url' must be an s3://, http(s):// or file:// URI, got {redact_url(url)!r}"
        )
    config = payload.get("config") or {}
    if not isinstance(config, dict):
        raise invalid("'config' must be a JSON object when given")
    return Task(task_id, job_id, image_id, url, config)


def make_result(
    *,
    task_id: str,
    job_id: str,
    image_id: str,
    pipeline: str,
    status: str,
    predictions: list[dict[str, Any]] | None,
    error: dict[str, Any] | None,
    model: dict[str, str],
    timings_s: dict[str, float],
    worker: dict[str, Any],
    attempt: int,
) -> dict[str, Any]:
    return {
        "task_id": task_id,
        "job_id": job_id,
        "image_id": image_id,
        "pipeline": pipeline,
        "status": status,
        "predictions": predictions or [],
        "error": error,
        "model": model,
        "timings_s": {k: round(v, 6) for k, v in timings_s.items()},
        "worker": worker,
        "attempt": attempt,
    }
