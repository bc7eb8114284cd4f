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

from config.settings import NatsSettings
from worker.nats.subjects import job_results_subject, job_tasks_subject
from worker.results import response_of
from worker.schemas import MAX_ID_BYTES, Task, subject_token

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


async def publish_tasks(
    js: JetStreamContext, settings: NatsSettings, pipeline: str, tasks: Iterable[Task]
) -> int:
    """One message per image on tasks.<pipeline>.<job>; (job, task) is the dedupe id.

    Up to ``_PUBLISH_WINDOW`` publishes wait for their acknowledgement at once, so a large job
    is not paced by one round trip per image. A failure raises; publishing the job again is
    safe, the stream drops task ids it already has.
    """
    count = 0
    window: list[Task] = []
    for task in tasks:
        window.append(task)
        if len(window) == _PUBLISH_WINDOW:
            count += await _publish_window(js, settings, pipeline, window)
            window = []
    return count + await _publish_window(js, settings, pipeline, window)


async def _publish_window(
    js: JetStreamContext, settings: NatsSettings, pipeline: str, tasks: list[Task]
) -> int:
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
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    return len(tasks)


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


async def job_task_ids(js: JetStreamContext, settings: NatsSettings, job_id: str) -> set[str]:
    """Task ids of the job still kept in the tasks stream: only the job's own subject
    (``tasks.*.<job>``) is read. Tasks published with the job in the payload only, on
    ``tasks.<pipeline>``, are not counted (``submit`` never publishes so)."""
    ids: set[str] = set()
    for data in await _read_all(js, settings.tasks_stream, f"tasks.*.{subject_token(job_id)}"):
        try:
            payload = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            continue
        if isinstance(payload, dict):
            task_id = payload.get("id")
            if isinstance(task_id, int) and not isinstance(task_id, bool):
                task_id = str(task_id)
            if isinstance(task_id, str):
                ids.add(task_id)
    return ids


@dataclass(frozen=True)
class Summary:
    ok: int
    error: int
    missing: int
    duplicates: int
    unreadable: int = 0

    def line(self) -> str:
        line = f"ok={self.ok} error={self.error} missing={self.missing}"
        return line + (f" unreadable={self.unreadable}" if self.unreadable else "")


def summarize(
    results: list[dict[str, Any]], expected_ids: set[str], unreadable: int = 0
) -> Summary:
    per_task = Counter(r["task_id"] for r in results)
    statuses = Counter(r["status"] for r in results)
    return Summary(
        ok=statuses.get("ok", 0),
        error=statuses.get("error", 0),
        missing=len(expected_ids - set(per_task)),
        duplicates=sum(n - 1 for n in per_task.values() if n > 1),
        unreadable=unreadable,
    )
