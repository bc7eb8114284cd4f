"""NATS subject and consumer names, and a subject's tokens, in one place. Imports nothing of
ours: the names the settings give come in a ``ConsumerNames``, built once from them
(``worker.nats.provision.consumer_names``).
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass

_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,128}")
_ENCODED_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,400}")  # b64 of up to 256 bytes, and the prefix
_ENCODED_PREFIX = "b64-"


def subject_token(value: str) -> str:
    """``value`` as one NATS subject token; injective, readable when already safe.

    Tokens never contain ``.``, so subjects joined from tokens are injective too. ``value``
    must be valid Unicode (``parse_task`` guarantees it for task and job ids).
    """
    if _TOKEN.fullmatch(value) and not value.startswith(_ENCODED_PREFIX):
        return value
    encoded = base64.urlsafe_b64encode(value.encode("utf-8")).decode("ascii").rstrip("=")
    return _ENCODED_PREFIX + encoded


def token_value(token: str) -> str | None:
    """The value ``subject_token`` made ``token`` from; None when no value makes it."""
    if not token.startswith(_ENCODED_PREFIX):
        return token if _TOKEN.fullmatch(token) else None
    if not _ENCODED_TOKEN.fullmatch(token):
        return None
    body = token[len(_ENCODED_PREFIX) :]
    try:
        value = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)).decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        return None
    return value if subject_token(value) == token else None


def subject_pipeline(subject: str) -> str:
    """The pipeline a task's subject names (``tasks.<pipeline>[.<job token>]``); "" if none."""
    parts = subject.split(".")
    if len(parts) in (2, 3) and parts[0] == "tasks":
        return parts[1]
    return ""


def subject_job(subject: str) -> str | None:
    """The job a task's subject names (``tasks.<pipeline>.<job token>``), if it names one."""
    parts = subject.split(".")
    if len(parts) != 3 or parts[0] != "tasks":
        return None
    return token_value(parts[2])


def result_subject(job_id: str, task_id: str) -> str:
    return f"results.{subject_token(job_id)}.{subject_token(task_id)}"


def job_results_subject(job_id: str) -> str:
    return f"results.{subject_token(job_id)}.>"


def tasks_subject(pipeline: str) -> str:
    return f"tasks.{pipeline}"


def job_tasks_subject(pipeline: str, job_token: str) -> str:
    """Where a job's tasks go: the job in the subject, so a job's tasks can be read alone."""
    return f"tasks.{pipeline}.{job_token}"


@dataclass(frozen=True)
class ConsumerNames:
    """The names every consumer part uses: the tasks stream (``WORKER_NATS__TASKS_STREAM``),
    the fleet's durable consumer (``WORKER_NATS__CONSUMER``, whose name begins the names of
    its other consumers) and the advisory stream (``WORKER_NATS__ADVISORY_STREAM``)."""

    tasks_stream: str
    consumer: str
    advisory_stream: str


def advisory_subject(names: ConsumerNames) -> str:
    """Max-deliveries advisories of every consumer on the tasks stream: the durable one and
    each job's (``worker.nats.job_consumers``)."""
    return consumer_advisory_subject(names, "*")


def advisory_consumer(names: ConsumerNames) -> str:
    return f"{names.consumer}-max-deliveries"


def new_jobs_consumer(names: ConsumerNames) -> str:
    """The shared consumer that reads one message per new task (``worker.nats.lifecycle``)."""
    return f"{names.consumer}-new-jobs"


def consumer_advisory_subject(names: ConsumerNames, consumer: str) -> str:
    """The max-deliveries advisories of one consumer on the tasks stream."""
    return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{names.tasks_stream}.{consumer}"
