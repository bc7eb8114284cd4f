"""The task (the SPEC's task schema), read once by its source: ``read_task`` says what a
message makes. Imports nothing of ours but the errors and the redaction helper; nothing here
knows a source (a subject's tokens are ``worker.nats``'s).

Everything in a task is untrusted until it passes ``parse_task`` (or ``task_of``): ids are
capped and checked here, once, before they reach a subject, a header, a file system,
a socket or a log line.

Which ids name the same task: ids compare as exact strings, after an integer id is written
in decimal (``17`` and ``"17"`` are one task; ``" 17"`` is another).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from config.errors import Failure, InvalidTask, Undeliverable
from config.redact import redact_url, shorten

URI_SCHEMES = ("s3://", "http://", "https://", "file://")
MAX_ID_BYTES = 256  # task id and job id, UTF-8; longer ids are dead-lettered
MAX_IMAGE_ID_BYTES = 1024
MAX_URL_CHARS = 8192
MAX_REPLY_SUBJECT_CHARS = 1024
_REPLY_SUBJECT = re.compile(r"[!-~]{1,1024}")  # printable ASCII, no spaces: one NATS subject


@dataclass(frozen=True)
class Task:
    id: str
    job_id: str
    image_id: str
    image_url: str
    config: dict[str, Any] = field(default_factory=dict)
    reply_subject: str | None = None
    # The pipeline that answers it: the one its source names (a NATS subject's, an Antenna
    # job's), else the default. Not part of the task's JSON.
    pipeline: str = ""

    def as_dict(self) -> dict[str, Any]:
        payload = {
            "id": self.id,
            "job_id": self.job_id,
            "image_id": self.image_id,
            "image_url": self.image_url,
            "config": self.config,
        }
        if self.reply_subject is not None:
            payload["reply_subject"] = self.reply_subject
        return payload


def invalid_task(error: InvalidTask, pipeline: str = "") -> Task:
    """The task an InvalidTask names, as far as it could be read: enough for its error result."""
    return Task(
        error.task_id,
        error.job_id,
        error.image_id,
        "",
        reply_subject=error.reply_subject,
        pipeline=pipeline,
    )


def _id_text(value: Any, max_bytes: int) -> tuple[str | None, str]:
    """``value`` as an id string, or None and why not."""
    if isinstance(value, int) and not isinstance(value, bool):
        # Its decimal form (a minus sign included) must fit in max_bytes, as a string's would.
        if not -(10 ** (max_bytes - 1)) < value < 10**max_bytes:
            return None, f"an integer longer than {max_bytes} bytes written in decimal"
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


def parse_task(data: bytes, *, pipeline: str = "", job_id: str | None = None) -> Task:
    """The task in ``data``, for ``pipeline``; Undeliverable when it cannot name its job and
    task, InvalidTask when it can but cannot be run. Never raises anything else, whatever
    ``data`` holds.

    The job is the one its source names (``job_id``: a NATS job subject's, an Antenna job's;
    Antenna's tasks carry no ``job_id``), else the task's ``job_id``. A task whose ``job_id``
    differs from its source's job gets an error result under the source's job, where
    ``results --job`` looks.
    """
    payload = _decode_json(data)
    if not isinstance(payload, dict):
        raise Undeliverable(f"expected a JSON object, got {type(payload).__name__}")
    return task_of(payload, pipeline=pipeline, job_id=job_id)


def task_of(payload: dict[str, Any], *, pipeline: str = "", job_id: str | None = None) -> Task:
    """The task in an already decoded JSON object (``parse_task``'s rules): Antenna's answer is
    decoded once by its client, and its tasks are read from it, not written back to bytes."""
    task_id, job_id = _named(payload, job_id)
    image_id, why_image = _id_text(payload.get("image_id"), MAX_IMAGE_ID_BYTES)
    reply = payload.get("reply_subject")
    reply_ok = reply is None or (isinstance(reply, str) and bool(_REPLY_SUBJECT.fullmatch(reply)))

    def invalid(reason: str) -> InvalidTask:
        return InvalidTask(
            reason,
            task_id=task_id,
            job_id=job_id,
            image_id=image_id or "",
            reply_subject=reply if reply_ok else None,
        )

    if "job_id" in payload and _id_text(payload["job_id"], MAX_ID_BYTES)[0] != job_id:
        raise invalid("'job_id' differs from the job its source names")
    if image_id is None:
        raise invalid(f"'image_id' is unusable: {why_image}")
    url = payload.get("image_url")
    if not isinstance(url, str):
        raise invalid(f"'image_url' must be a string URI, got {type(url).__name__}")
    why_url = _url_problem(url)
    if why_url is not None:
        raise invalid(why_url)
    config = payload.get("config")
    if config is None:  # absent or null: no per-task settings
        config = {}
    if not isinstance(config, dict):
        raise invalid("'config' must be a JSON object when given")
    if not reply_ok:
        raise invalid(
            f"'reply_subject' must be one NATS subject of at most {MAX_REPLY_SUBJECT_CHARS} "
            "printable characters when given"
        )
    return Task(task_id, job_id, image_id, url, config, reply, pipeline)


def _named(payload: dict[str, Any], source_job: str | None) -> tuple[str, str]:
    """The task's id and its job's (the source's, else the task's ``job_id``); Undeliverable
    when either is unusable."""
    task_id, why_task = _id_text(payload.get("id"), MAX_ID_BYTES)
    if task_id is None:
        raise Undeliverable(f"'id' is unusable: {why_task}")
    if source_job is not None and _id_text(source_job, MAX_ID_BYTES)[0] is not None:
        return task_id, source_job
    job_id, why_job = _id_text(payload.get("job_id"), MAX_ID_BYTES)
    if job_id is None:
        raise Undeliverable(f"'job_id' is unusable and its source names no job: {why_job}")
    return task_id, job_id


def _url_problem(url: str) -> str | None:
    """Why ``url`` cannot be a task's ``image_url``, or None when it can."""
    if len(url) > MAX_URL_CHARS:
        return f"'image_url' is {len(url)} characters long, over {MAX_URL_CHARS}"
    if (
        not url.startswith(URI_SCHEMES)
        or _id_text(url, 4 * MAX_URL_CHARS)[0] is None
        or any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in url)
    ):
        return f"'image_url' must be an s3://, http(s):// or file:// URI, got {redact_url(url)!r}"
    return None


@dataclass(frozen=True)
class Read:
    """What a delivered message makes: a task, a task that cannot be run (``failure``: it gets
    an error result), or nothing that names a job and a task (``task`` None: kept aside with
    ``unnamed_reason``)."""

    task: Task | None
    failure: Failure | None = None
    unnamed_reason: str = ""


def read_task(
    payload: bytes | dict[str, Any], pipeline: str, job_id: str | None, default_pipeline: str
) -> Read:
    """What a message's bytes (or its decoded object) make, for the pipeline and job its source
    names: the pipeline, when the source names none, is ``default_pipeline`` (the one place an
    unnamed pipeline becomes the default)."""
    pipeline = pipeline or default_pipeline
    try:
        if isinstance(payload, dict):
            return Read(task_of(payload, pipeline=pipeline, job_id=job_id))
        return Read(parse_task(payload, pipeline=pipeline, job_id=job_id))
    except Undeliverable as error:
        return Read(None, unnamed_reason=str(error))
    except InvalidTask as error:
        return Read(invalid_task(error, pipeline), error.failure())
