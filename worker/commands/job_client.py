"""Client side: publish a job's tasks, read a job's results. No torch here."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import nats
from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError

from config.settings import NatsSettings
from worker.core.tasks import MAX_ID_BYTES, Task
from worker.nats.result_store import response_of
from worker.nats.subjects import job_results_subject, job_tasks_subject, subject_token

_READ_BATCH = 256
_PUBLISH_WINDOW = 64


def task_id(uri: str, repeat: int = 1) -> str:
    """A submitted task's id, from its URI alone, so submitting a job again (a prefix listed
    again after more objects arrived) names every object's task as before and the stream drops
    the copies: the URI itself; ``n:`` before it for the n-th time one submission names the
    same URI (a URI's scheme starts with a letter, so no URI reads so); ``sha256-`` and the
    hex digest of that when it is over the id cap (MAX_ID_BYTES)."""
    text = uri if repeat == 1 else f"{repeat}:{uri}"
    if len(text.encode("utf-8", "surrogatepass")) <= MAX_ID_BYTES:
        return text
    return "sha256-" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def image_name(uri: str) -> str:
    """The last segment of the URI's key or path (an S3 key taken whole: ``#`` and ``?`` are
    part of it)."""
    s3 = uri.startswith("s3://")
    path = uri[len("s3://") :].partition("/")[2] if s3 else urlsplit(uri).path
    return path.rsplit("/", 1)[-1]


def make_tasks(job_id: str, uris: Iterable[str]) -> list[Task]:
    """One task per URI; its id follows from the URI (``task_id``), never from its position."""
    tasks = []
    seen: Counter[str] = Counter()
    for index, uri in enumerate(uris):
        seen[uri] += 1
        image_id = image_name(uri) or f"image-{index}"
        tasks.append(Task(task_id(uri, seen[uri]), job_id, image_id, uri))
    return tasks


def list_s3_prefix(s3_client: Any, uri: str) -> list[str]:
    """Every object under ``s3://bucket/prefix`` as an ``s3://`` URI, sorted (keys as they
    are, ``#`` and ``?`` included)."""
    bucket, _, prefix = uri[len("s3://") :].partition("/")
    uris: list[str] = []
    for page in s3_client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        uris.extend(f"s3://{bucket}/{obj['Key']}" for obj in page.get("Contents", []))
    return sorted(uris)


@dataclass(frozen=True)
class Published:
    new: int  # stored by the tasks stream
    duplicates: int  # dropped by it: their (job, task) id was in its duplicate window


async def publish_tasks(
    js: JetStreamContext, settings: NatsSettings, pipeline: str, tasks: Iterable[Task]
) -> Published:
    """One message per image on tasks.<pipeline>.<job>; (job, task) is the dedupe id.

    Up to ``_PUBLISH_WINDOW`` publishes wait for their acknowledgement at once, so a large job
    is not paced by one round trip per image. A failure raises; publishing the job again is
    safe, the stream drops task ids it already has (each PubAck says so: ``duplicate``).
    """
    new = duplicates = 0
    window: list[Task] = []
    for task in tasks:
        window.append(task)
        if len(window) == _PUBLISH_WINDOW:
            added, dropped = await _publish_window(js, settings, pipeline, window)
            new, duplicates, window = new + added, duplicates + dropped, []
    added, dropped = await _publish_window(js, settings, pipeline, window)
    return Published(new + added, duplicates + dropped)


async def _publish_window(
    js: JetStreamContext, settings: NatsSettings, pipeline: str, tasks: list[Task]
) -> tuple[int, int]:
    """(stored, dropped as duplicates) of one window of publishes."""
    outcomes = await asyncio.gather(
        *(
            js.publish(
                job_tasks_subject(pipeline, subject_token(task.job_id)),
                json.dumps(task.as_dict()).encode(),
                stream=settings.tasks_stream,
                # Injective (job, task) -> id: "job/task" joined by hand is not.
                headers={"Nats-Msg-Id": f"{subject_token(task.job_id)}.{subject_token(task.id)}"},
            )
            for task in tasks
        ),
        return_exceptions=True,  # every publish of the window has ended before we raise
    )
    duplicates = 0
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
        duplicates += bool(outcome.duplicate)
    return len(tasks) - duplicates, duplicates


async def _read_all(js: JetStreamContext, stream: str, subject: str) -> list[bytes]:
    """Every message on ``subject`` in ``stream`` now, through a short-lived ephemeral consumer."""
    sub = await js.pull_subscribe(
        subject,
        stream=stream,
        config=api.ConsumerConfig(
            ack_policy=api.AckPolicy.NONE,
            deliver_policy=api.DeliverPolicy.ALL,
            inactive_threshold=30.0,
        ),
    )
    try:
        info = await sub.consumer_info()
        remaining = info.num_pending or 0
        out: list[bytes] = []
        while remaining > 0:
            try:
                msgs = await sub.fetch(min(_READ_BATCH, remaining), timeout=5)
            except (nats.errors.TimeoutError, TimeoutError):
                break
            out.extend(msg.data for msg in msgs)
            remaining -= len(msgs)
        return out
    finally:
        await sub.unsubscribe()


def read_result(data: bytes) -> dict[str, Any] | None:
    """A message on ``results.<job>.*`` as a result: a JSON object with a string (or integer)
    ``task_id`` and a string ``status``; None for anything else (bytes that are not UTF-8,
    not JSON, an array, a result without its fields), which a client may have published."""
    try:
        result = json.loads(data)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError included
        return None
    if not isinstance(result, dict) or not isinstance(result.get("status"), str):
        return None
    task_id = result.get("task_id")
    if isinstance(task_id, bool) or not isinstance(task_id, str | int):
        return None
    return {**result, "task_id": str(task_id)}


@dataclass(frozen=True)
class JobResults:
    results: list[dict[str, Any]]
    unreadable: int  # messages on the job's result subjects that are no result


async def read_job_results(js: JetStreamContext, settings: NatsSettings, job_id: str) -> JobResults:
    """The job's results, each whole (a response kept in the object store is put back); a
    message that is no result is counted and skipped, so it never hides the others."""
    raw = await _read_all(js, settings.results_stream, job_results_subject(job_id))
    results: list[dict[str, Any]] = []
    for data in raw:
        result = read_result(data)
        if result is not None:
            results.append(await response_of(js, result))
    return JobResults(results, len(raw) - len(results))


async def job_results(
    js: JetStreamContext, settings: NatsSettings, job_id: str
) -> list[dict[str, Any]]:
    """The job's readable results (``read_job_results`` also counts the unreadable)."""
    return (await read_job_results(js, settings, job_id)).results


_NO_MESSAGE = 10037  # JetStream's "no message found"


class JobTasks:
    """A job's task ids as the tasks stream keeps them (``tasks.*.<job>``), read message by
    message with the stream's get-next-by-subject: no consumer on the tasks stream, which a
    busy server (its consumer limit reached by the job consumers) may refuse. ``refresh``
    reads on from where the last one ended, so following a job being published costs one
    request per new task. Tasks published with the job in the payload only, on
    ``tasks.<pipeline>``, are not counted (``submit`` never publishes so)."""

    def __init__(self, js: JetStreamContext, settings: NatsSettings, job_id: str) -> None:
        self._js, self._stream = js, settings.tasks_stream
        self._subject = f"tasks.*.{subject_token(job_id)}"
        self._next_seq = 1
        self.ids: set[str] = set()

    async def refresh(self) -> set[str]:
        """Read the job's tasks published since the last refresh; returns every id known."""
        last_seq = (await self._js.stream_info(self._stream)).state.last_seq
        while self._next_seq <= last_seq:  # each read moves past one message: bounded
            try:
                msg = await self._js.get_msg(
                    self._stream, seq=self._next_seq, subject=self._subject, next=True
                )
            except NotFoundError as error:
                if error.err_code != _NO_MESSAGE:
                    raise  # the stream itself is gone
                break
            self._next_seq = (msg.seq or self._next_seq) + 1
            found = _task_id_of(msg.data or b"")
            if found is not None:
                self.ids.add(found)
        return self.ids


def _task_id_of(data: bytes) -> str | None:
    try:
        payload = json.loads(data)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError included
        return None
    task_id = payload.get("id") if isinstance(payload, dict) else None
    if isinstance(task_id, int) and not isinstance(task_id, bool):
        return str(task_id)
    return task_id if isinstance(task_id, str) else None


async def job_task_ids(js: JetStreamContext, settings: NatsSettings, job_id: str) -> set[str]:
    """Task ids of the job still kept in the tasks stream (see ``JobTasks``)."""
    return await JobTasks(js, settings, job_id).refresh()


def unreadable_response(result: dict[str, Any]) -> bool:
    """A result whose response was kept in the object store and cannot be read back
    (``response_of`` says why in ``response_error``): it is no usable ``ok``."""
    return bool(result.get("response_error"))


@dataclass(frozen=True)
class Summary:
    ok: int
    error: int
    missing: int
    duplicates: int
    unreadable: int = 0  # messages on the job's result subjects that are no result
    foreign: int = 0  # results whose task id is no task of the job: not counted
    response_unreadable: int = 0  # `ok` results whose stored response cannot be read

    def line(self) -> str:
        line = f"ok={self.ok} error={self.error} missing={self.missing}"
        for name in ("response_unreadable", "foreign", "unreadable"):
            if getattr(self, name):
                line += f" {name}={getattr(self, name)}"
        return line


def summarize(
    results: list[dict[str, Any]], expected_ids: set[str], unreadable: int = 0
) -> Summary:
    """Counts over the results of the job's own tasks (``expected_ids``); a result for any
    other id is ``foreign``, an ``ok`` whose response cannot be read ``response_unreadable``."""
    mine = [r for r in results if r["task_id"] in expected_ids]
    per_task = Counter(r["task_id"] for r in mine)
    statuses = Counter(
        "response_unreadable" if unreadable_response(r) else r["status"] for r in mine
    )
    return Summary(
        ok=statuses.get("ok", 0),
        error=statuses.get("error", 0),
        missing=len(expected_ids - set(per_task)),
        duplicates=sum(n - 1 for n in per_task.values() if n > 1),
        unreadable=unreadable,
        foreign=len(results) - len(mine),
        response_unreadable=statuses.get("response_unreadable", 0),
    )
