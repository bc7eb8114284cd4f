"""The names and the configuration of job consumers (``worker.nats.job_consumers``), in one
place."""

from __future__ import annotations

import hashlib

from nats.js import api

from config.settings import NatsSettings
from worker.nats.provision import task_consumer_config


def job_consumer(settings: NatsSettings, subject: str) -> str:
    """The consumer of one job subject: the same name in every worker process."""
    digest = hashlib.sha256(subject.encode()).hexdigest()[:16]
    return f"{settings.consumer}-job-{digest}"


def is_job_consumer(settings: NatsSettings, name: str) -> bool:
    """Whether ``name`` is one of our job consumers' (``job_consumer``'s form)."""
    prefix = f"{settings.consumer}-job-"
    digest = name.removeprefix(prefix)
    return (
        name.startswith(prefix)
        and len(digest) == 16
        and all(c in "0123456789abcdef" for c in digest)
    )


def job_consumer_config(settings: NatsSettings, subject: str) -> api.ConsumerConfig:
    return task_consumer_config(
        settings,
        job_consumer(settings, subject),
        description=subject,
        filter_subject=subject,
        inactive_threshold=settings.job_consumer_inactive_s or settings.tasks_max_age_s,
    )
