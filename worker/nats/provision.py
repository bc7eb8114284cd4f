"""Provisioning: the streams, the durable tasks consumer and the advisories consumer;
idempotent.
"""

from __future__ import annotations

from typing import Any

import structlog
from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError

from config.names import env_name
from config.settings import ConfigError, NatsSettings
from worker.nats.job_names import job_consumer
from worker.nats.subjects import (
    ConsumerNames,
    advisory_consumer,
    advisory_subject,
    job_tasks_subject,
    new_jobs_consumer,
    tasks_subject,
)

log = structlog.get_logger(__name__)
DEAD_LETTER_DEDUPE_S = 3600.0
SCOUT_BATCH = 256  # new-job messages read per discovery (worker.nats.lifecycle)
SCOUT_ACK_WAIT_S = 30.0


def consumer_names(settings: NatsSettings) -> ConsumerNames:
    """The names the consumer parts use, as the settings give them."""
    return ConsumerNames(settings.tasks_stream, settings.consumer, settings.advisory_stream)


def stream_configs(settings: NatsSettings) -> list[api.StreamConfig]:
    return [
        api.StreamConfig(
            name=settings.tasks_stream,
            subjects=["tasks.>"],
            retention=api.RetentionPolicy.LIMITS,
            storage=api.StorageType.FILE,
            max_age=settings.tasks_max_age_s,
            # Full: a new task is refused (the submitter sees it); queued ones are never dropped.
            max_bytes=settings.tasks_max_bytes,
            max_msgs=settings.tasks_max_msgs,
            discard=api.DiscardPolicy.NEW,
            num_replicas=settings.replicas,
        ),
        # One message per task subject, new ones refused: at most one result per task id
        # for as long as results are kept, not only inside the deduplication window.
        api.StreamConfig(
            name=settings.results_stream,
            subjects=["results.>"],
            retention=api.RetentionPolicy.LIMITS,
            storage=api.StorageType.FILE,
            max_msgs_per_subject=1,
            discard=api.DiscardPolicy.NEW,
            discard_new_per_subject=True,
            max_age=settings.results_max_age_s,
            max_bytes=settings.results_max_bytes,
            max_msgs=settings.results_max_msgs,
            allow_direct=True,
            num_replicas=settings.replicas,
        ),
        api.StreamConfig(
            name=settings.dead_letter_stream,
            subjects=[settings.dead_letter_subject],
            retention=api.RetentionPolicy.LIMITS,
            storage=api.StorageType.FILE,
            max_age=settings.results_max_age_s,
            max_bytes=settings.dead_letter_max_bytes,
            # The worker and the max-deliveries handler may both dead-letter one message
            # minutes apart; the dedupe id (its tasks-stream sequence) keeps it once.
            duplicate_window=min(DEAD_LETTER_DEDUPE_S, settings.results_max_age_s),
            num_replicas=settings.replicas,
        ),
    ]


def task_consumer_config(settings: NatsSettings, name: str, **which: Any) -> api.ConsumerConfig:
    """A durable consumer of tasks named ``name``: the shared one, or a job's
    (``worker.nats.job_consumers``); ``which`` says what it filters, and for a job its description
    and inactive threshold. Both deliver alike: explicit acks, from the first task on, with the ack
    wait and the delivery cap that the settle rules count on."""
    return api.ConsumerConfig(
        name=name,
        durable_name=name,
        ack_policy=api.AckPolicy.EXPLICIT,
        deliver_policy=api.DeliverPolicy.ALL,
        ack_wait=settings.ack_wait_s,
        max_deliver=settings.max_deliver,
        max_ack_pending=10_000,
        max_waiting=512,
        num_replicas=settings.replicas if settings.replicas > 1 else None,
        **which,
    )


def consumer_config(settings: NatsSettings, pipelines: str | list[str]) -> api.ConsumerConfig:
    return task_consumer_config(
        settings,
        settings.consumer,
        # Tasks with the job in the payload, and tasks with the job in the subject (Antenna's),
        # of every pipeline served.
        # With a consumer per job (fair_jobs, worker.nats.job_consumers), only the former.
        filter_subjects=[
            subject
            for pipeline in as_list(pipelines)
            for subject in (
                (tasks_subject(pipeline),)
                if settings.fair_jobs
                else (tasks_subject(pipeline), job_tasks_subject(pipeline, "*"))
            )
        ],
    )


def job_consumer_config(settings: NatsSettings, subject: str) -> api.ConsumerConfig:
    """The consumer of one job subject (``worker.nats.job_names``), made and kept alike by every
    worker process (``worker.nats.consumer_maker``, ``worker.nats.drift_repair``)."""
    return task_consumer_config(
        settings,
        job_consumer(consumer_names(settings), subject),
        description=subject,
        filter_subject=subject,
        inactive_threshold=settings.job_consumer_inactive_s or settings.tasks_max_age_s,
    )


def new_jobs_consumer_config(settings: NatsSettings, pipelines: list[str]) -> api.ConsumerConfig:
    name = new_jobs_consumer(consumer_names(settings))
    return api.ConsumerConfig(
        name=name,
        durable_name=name,
        description="new jobs: one message per task, headers only (worker.nats.lifecycle)",
        ack_policy=api.AckPolicy.EXPLICIT,
        deliver_policy=api.DeliverPolicy.ALL,
        filter_subjects=[job_tasks_subject(pipeline, "*") for pipeline in pipelines],
        headers_only=True,
        ack_wait=SCOUT_ACK_WAIT_S,
        max_deliver=-1,  # given back while a job waits for room: never dropped
        max_ack_pending=SCOUT_BATCH * 64,
        num_replicas=settings.replicas if settings.replicas > 1 else None,
    )


def advisory_stream_config(settings: NatsSettings) -> api.StreamConfig:
    return api.StreamConfig(
        name=settings.advisory_stream,
        subjects=[advisory_subject(consumer_names(settings))],
        retention=api.RetentionPolicy.LIMITS,
        storage=api.StorageType.FILE,
        max_age=settings.tasks_max_age_s,
        max_bytes=settings.advisory_max_bytes,
        num_replicas=settings.replicas,
    )


def advisory_consumer_config(settings: NatsSettings) -> api.ConsumerConfig:
    name = advisory_consumer(consumer_names(settings))
    return api.ConsumerConfig(
        name=name,
        durable_name=name,
        ack_policy=api.AckPolicy.EXPLICIT,
        deliver_policy=api.DeliverPolicy.ALL,
        ack_wait=60.0,
        # Unlimited: an outage of the stores is waited out with backoff; a poison advisory
        # is terminated by the handler after a few attempts (advisories.POISON_ATTEMPTS).
        max_deliver=-1,
        num_replicas=settings.replicas if settings.replicas > 1 else None,
    )


def serves_job_subjects(config: api.ConsumerConfig) -> bool:
    """Whether the shared consumer's filter takes ``tasks.<pipeline>.*`` too: made by a process
    with ``WORKER_NATS__FAIR_JOBS=false`` (with fair share it takes ``tasks.<pipeline>``)."""
    filters = config.filter_subjects or ([config.filter_subject] if config.filter_subject else [])
    return any(f.endswith(".*") or f.endswith(".>") for f in filters)


async def refuse_other_fair_jobs(js: JetStreamContext, settings: NatsSettings) -> None:
    """ConfigError (exit 2) when the shared consumer exists and serves the other
    ``WORKER_NATS__FAIR_JOBS``: processes that differ there would each deliver every job task
    (one through the shared consumer, one through the job's own)."""
    try:
        info = await js.consumer_info(settings.tasks_stream, settings.consumer)
    except NotFoundError:
        return
    theirs = not serves_job_subjects(info.config)
    if theirs != settings.fair_jobs:
        ours, other = str(settings.fair_jobs).lower(), str(theirs).lower()
        raise ConfigError(
            f"{env_name('nats', 'fair_jobs')}={ours}: consumer {settings.consumer} on stream "
            f"{settings.tasks_stream} serves {env_name('nats', 'fair_jobs')}={other} (its filter: "
            f"{', '.join(info.config.filter_subjects or [info.config.filter_subject or ''])}); "
            "every process sharing it needs the same setting (to change it, stop them all "
            "and run `provision` with the new one)"
        )


async def provision(
    js: JetStreamContext, settings: NatsSettings, pipelines: str | list[str]
) -> list[str]:
    """Create or update the streams and the durable consumer; safe to run any number of times."""
    done: list[str] = []
    for config in [*stream_configs(settings), advisory_stream_config(settings)]:
        try:
            await js.stream_info(config.name)  # type: ignore[arg-type]
        except NotFoundError:
            await js.add_stream(config)
            done.append(f"created stream {config.name}")
        else:
            await js.update_stream(config)
            done.append(f"updated stream {config.name}")
    # Responses outlive their results by a day (written first, they must not expire first);
    # category maps never expire.
    for bucket, ttl_s in (
        (settings.result_objects, settings.results_max_age_s + 86400.0),
        (settings.algorithms, None),
    ):
        try:
            await js.object_store(bucket)
        except NotFoundError:
            await js.create_object_store(
                bucket,
                config=api.ObjectStoreConfig(
                    ttl=ttl_s, storage=api.StorageType.FILE, replicas=settings.replicas
                ),
            )
            done.append(f"created object store {bucket}")
    # pull_subscribe ignores the config of an existing durable; add_consumer with a name
    # creates it or updates it in place.
    tasks = consumer_config(settings, pipelines)
    await js.add_consumer(settings.tasks_stream, tasks)
    subjects = " and ".join(tasks.filter_subjects or [])
    done.append(f"created or updated consumer {settings.consumer} on {subjects}")
    watcher = advisory_consumer_config(settings)
    await js.add_consumer(settings.advisory_stream, watcher)
    done.append(f"created or updated consumer {watcher.name} on max-deliveries advisories")
    if settings.fair_jobs:
        scout = new_jobs_consumer_config(settings, as_list(pipelines))
        await js.add_consumer(settings.tasks_stream, scout)
        done.append(f"created or updated consumer {scout.name} (new jobs, headers only)")
    return done


def as_list(pipelines: str | list[str]) -> list[str]:
    return [pipelines] if isinstance(pipelines, str) else pipelines
