"""Task and result messages (the SPEC's schemas) and subject tokens. Imports nothing of ours."""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass, field
from typing import Any

_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_ENCODED_PREFIX = "b64-"
URI_SCHEMES = ("s3://", "http://", "https://", "file://")


def subject_token(value: str) -> str:
    """``value`` as one NATS subject token; injective, readable when already safe."""
    if _TOKEN.match(value) and not value.startswith(_ENCODED_PREFIX):
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
    """What became of a task's work: predictions, or an error (kind, message, retryable)."""

    predictions: list[dict[str, Any]] | None = None
    error_kind: str | None = None
    error_message: str | None = None
    retryable: bool = False
    timings_s: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error_kind is None


class Undeliverable(Exception):
    """Too broken to name its job and task: goes to the dead-letter subject."""


class InvalidTask(Exception):
    """Names its job and task but cannot be processed: gets an ``error`` result."""

    def __init__(self, reason: str, *, task_id: str, job_id: str, image_id: str) -> None:
        super().__init__(reason)
        self.task_id = task_id
        self.job_id = job_id
        self.image_id = image_id


def _text(payload: dict[str, Any], name: str) -> str | None:
    value = payload.get(name)
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    return value if isinstance(value, str) and value else None


def parse_task(data: bytes) -> Task:
    try:
        payload = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise Undeliverable(f"not JSON: {error}") from None
    if not isinstance(payload, dict):
        raise Undeliverable(f"expected a JSON object, got {type(payload).__name__}")
    task_id, job_id = _text(payload, "id"), _text(payload, "job_id")
    if task_id is None or job_id is None:
        raise Undeliverable("the task has no usable 'id' and 'job_id' strings")
    image_id = _text(payload, "image_id") or ""

    def invalid(reason: str) -> InvalidTask:
        return InvalidTask(reason, task_id=task_id, job_id=job_id, image_id=image_id)

    if not image_id:
        raise invalid("'image_id' is missing or not a string")
    url = payload.get("image_url")
    if not isinstance(url, str) or not url.startswith(URI_SCHEMES):
        raise invalid(f"'image_url' must be an s3://, http(s):// or file:// URI, got {url!r}")
    config = payload.get("config") or {}
    if not isinstance(config, dict):
        raise invalid("'config' must be a JSON object when given")
    return Task(task_id, job_id, image_id, url, config)


def error_info(kind: str, message: str, retryable: bool) -> dict[str, Any]:
    return {"type": kind, "message": message, "retryable": retryable}


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
