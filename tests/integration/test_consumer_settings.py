"""Every consumer a worker reads from carries the delivery settings it was started with, and
processes that differ in WORKER_NATS__FAIR_JOBS never share a consumer (a task delivered
twice), through the real worker and nats-server."""

from __future__ import annotations

import pytest

from tests.helpers import (
    cli,
    client,
    quiescent,
    running_worker,
    submit,
    upload_images,
    wait_results,
    worker_env,
)
from worker.nats.job_consumers import job_consumer, job_consumer_config
from worker.nats.provision import consumer_names, provision
from worker.nats.subjects import job_tasks_subject, subject_token

pytestmark = pytest.mark.integration


async def test_a_restart_with_a_new_ack_wait_and_max_deliver_updates_the_job_consumers(
    nats_server, s3_server, bucket, settings_for
):
    before = settings_for(nats_server.url)
    uris = upload_images(s3_server.client(), bucket, 2)
    n = before.nats
    subject = job_tasks_subject(before.model.pipeline, subject_token("job-drift"))
    async with client(before) as js:
        # Given a job whose consumer a worker with the default settings made
        await provision(js, n, before.model.pipeline)
        await submit(js, before, "job-drift", uris)
        made = await js.add_consumer(n.tasks_stream, job_consumer_config(n, subject))
        assert (made.config.ack_wait, made.config.max_deliver) == (300.0, 5)
        # When a worker starts with a new ack wait and delivery cap
        after = settings_for(nats_server.url, nats={"ack_wait_s": 900.0, "max_deliver": 2})
        async with running_worker(after):
            info = await js.consumer_info(n.tasks_stream, job_consumer(consumer_names(n), subject))
            results = await wait_results(js, after, "job-drift", 2, timeout_s=60)
            await quiescent(js, after)
    # Then the job's consumer delivers by them, as the shared one does
    assert (info.config.ack_wait, info.config.max_deliver) == (900.0, 2)
    assert {r["status"] for r in results} == {"ok"}


@pytest.mark.parametrize("first_fair", [True, False], ids=["fair-first", "stream-order-first"])
async def test_a_process_with_the_other_fair_jobs_is_refused_and_no_task_runs_twice(
    first_fair, nats_server, s3_server, bucket, settings_for
):
    settings = settings_for(nats_server.url, nats={"fair_jobs": first_fair})
    uris = upload_images(s3_server.client(), bucket, 4)
    other = str(not first_fair).lower()
    async with running_worker(settings) as app, client(settings) as js:
        # When a process with the other WORKER_NATS__FAIR_JOBS starts on the same consumer
        env = worker_env(settings, WORKER_NATS__FAIR_JOBS=other, WORKER_METRICS__PORT="0")
        refused = cli("run", env=env, timeout=120)
        # Then it ends at once with exit 2, one line naming the consumer
        # And the 40 tasks published are each run once
        results = []
        for j in range(4):
            await submit(js, settings, f"job-mixed-{j}", (uris * 3)[:10])
        for j in range(4):
            results += await wait_results(js, settings, f"job-mixed-{j}", 10, timeout_s=120)
        await quiescent(js, settings)
        twice = app.registry.get_sample_value("inference_worker_results_already_stored_total")
        served = {"outcome": "ok", "pipeline": settings.model.pipeline}
        ok = app.registry.get_sample_value("inference_worker_tasks_total", served)
    assert refused.returncode == 2, refused.stderr[-3000:]
    errors = [line for line in refused.stderr.splitlines() if line.startswith("config error")]
    assert len(errors) == 1 and n_consumer(settings) in errors[0], refused.stderr[-3000:]
    assert f"WORKER_NATS__FAIR_JOBS={other}" in errors[0]
    assert "Traceback" not in refused.stderr
    assert len(results) == 40 and ok == 40 and twice == 0


def n_consumer(settings) -> str:
    return str(settings.nats.consumer)


async def test_a_job_consumer_made_later_with_other_settings_is_given_ours_at_discovery(
    nats_server, settings_for, capsys
):
    from worker.nats.job_consumers import JobConsumers

    settings = settings_for(nats_server.url, nats={"ack_wait_s": 900.0, "max_deliver": 2})
    n, pipeline = settings.nats, settings.model.pipeline
    subject = job_tasks_subject(pipeline, subject_token("job-later"))
    async with client(settings) as js:
        await provision(js, n, pipeline)
        jobs = JobConsumers(js, n, [pipeline])
        await jobs.open()
        # Given a job consumer made after this process started, by one with the defaults
        older = settings_for(nats_server.url).nats.model_copy(
            update={"consumer": n.consumer, "tasks_stream": n.tasks_stream}
        )
        await js.add_consumer(n.tasks_stream, job_consumer_config(older, subject))
        # When this process discovers jobs, twice
        for _ in range(2):
            await jobs.refresh()
        info = await js.consumer_info(n.tasks_stream, job_consumer(consumer_names(n), subject))
        await jobs.close()
    # Then the consumer delivers by this process's settings, said once and counted
    assert (info.config.ack_wait, info.config.max_deliver) == (900.0, 2)
    assert capsys.readouterr().out.count("job_consumer_settings_differ") == 1
    assert jobs.stats.updated == 1
