"""NATS subject and consumer names, in one place. Imports nothing of ours but the
schemas' subject tokens.
"""

from __future__ import annotations

from config.settings import NatsSettings
from worker.schemas import subject_token


def result_subject(job_id: str, task_id: str) -> str:
    return f"results.{subject_token(job_id)}.{subject_token(task_id)}"


def job_results_subject(job_id: str) -> str:
    return f"results.{subject_token(job_id)}.>"


def tasks_subject(pipeline: str) -> str:
    return f"tasks.{pipeline}"


def job_tasks_subject(pipeline: str, job_token: str) -> str:
    """Where a job's tasks go: the job in the subject, so a job's tasks can be read alone."""
    return f"tasks.{pipeline}.{job_token}"


def advisory_subject(settings: NatsSettings) -> str:
    """Max-deliveries advisories of every consumer on the tasks stream: the durable one and
    each job's (``worker.nats.jobs``)."""
    return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{settings.tasks_stream}.*"


def advisory_consumer(settings: NatsSettings) -> str:
    return f"{settings.consumer}-max-deliveries"


def consumer_advisory_subject(settings: NatsSettings, consumer: str) -> str:
    """The max-deliveries advisories of one consumer on the tasks stream."""
    return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{settings.tasks_stream}.{consumer}"
