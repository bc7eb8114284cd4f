"""Tasks waiting, as /metrics says it (``inference_worker_tasks_waiting{pipeline}``), through the
real worker and a real nats-server: tasks published while its consumers are paused (a worker
alive and not consuming) are counted, on the shared consumer and on a job's own consumer
alike, within the read interval; once the consumers resume and the worker serves them, the
count drops to 0."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import client, publish_raw, running_worker, submit, upload_images, wait_results
from worker.commands.job_client import make_tasks
from worker.nats.job_names import job_consumer
from worker.nats.provision import consumer_names, job_consumer_config
from worker.nats.subjects import job_tasks_subject, subject_token

pytestmark = pytest.mark.integration

READ_S = 0.5  # WORKER_METRICS__TASKS_WAITING_READ_S here
WAIT_S = 20.0  # for the gauge to show what the test did: many read intervals


def waiting(registry) -> dict[str, float]:
    text = generate_latest(registry).decode()
    return {
        sample.labels["pipeline"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "inference_worker_tasks_waiting"
        for sample in family.samples
    }


async def until(registry, wanted: dict[str, float]) -> dict[str, float]:
    deadline = time.monotonic() + WAIT_S
    seen = waiting(registry)
    while seen != wanted and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        seen = waiting(registry)
    return seen


@pytest.mark.timeout(120)
async def test_tasks_waiting_counts_what_paused_consumers_hold_then_drops(
    nats_server, s3_server, bucket, settings_for
):
    settings = settings_for(nats_server.url, metrics={"port": 0, "tasks_waiting_read_s": READ_S})
    n, pipeline = settings.nats, settings.model.pipeline
    uris = upload_images(s3_server.client(), bucket, 5)
    job_subject = job_tasks_subject(pipeline, subject_token("job-paused"))
    far = "2099-01-01T00:00:00Z"
    async with client(settings) as js, running_worker(settings) as app:
        assert await until(app.registry, {pipeline: 0}) == {pipeline: 0}, "nothing waits"
        # The job's consumer made as the worker makes it, then paused with the shared one.
        await js.add_consumer(n.tasks_stream, job_consumer_config(n, job_subject))
        await js.pause_consumer(n.tasks_stream, job_consumer(consumer_names(n), job_subject), far)
        await js.pause_consumer(n.tasks_stream, n.consumer, far)
        await submit(js, settings, "job-paused", uris[:3])  # on tasks.<pipeline>.<job>
        for task in make_tasks("job-shared", uris[3:]):  # on tasks.<pipeline>
            await publish_raw(js, settings, task.as_dict())

        assert await until(app.registry, {pipeline: 5}) == {pipeline: 5}

        await js.resume_consumer(n.tasks_stream, n.consumer)
        await js.resume_consumer(n.tasks_stream, job_consumer(consumer_names(n), job_subject))
        await wait_results(js, settings, "job-paused", 3)
        await wait_results(js, settings, "job-shared", 2)
        assert await until(app.registry, {pipeline: 0}) == {pipeline: 0}
