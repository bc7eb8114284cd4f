"""The names of job consumers (``worker.nats.job_consumers``), in one place; their
configuration is ``worker.nats.provision.job_consumer_config``."""

from __future__ import annotations

import hashlib

from worker.nats.subjects import ConsumerNames


def job_consumer(names: ConsumerNames, subject: str) -> str:
    """The consumer of one job subject: the same name in every worker process."""
    digest = hashlib.sha256(subject.encode()).hexdigest()[:16]
    return f"{names.consumer}-job-{digest}"


def is_job_consumer(names: ConsumerNames, name: str) -> bool:
    """Whether ``name`` is one of our job consumers' (``job_consumer``'s form)."""
    prefix = f"{names.consumer}-job-"
    digest = name.removeprefix(prefix)
    return (
        name.startswith(prefix)
        and len(digest) == 16
        and all(c in "0123456789abcdef" for c in digest)
    )
