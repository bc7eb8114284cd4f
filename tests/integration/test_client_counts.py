"""`submit`, `watch` and `results` count what really happened (issue 32): a repeated submit
says what the stream dropped; a result for an id that is no task of the job, or an `ok`
whose stored response cannot be read back, is not counted as the job's `ok`; and neither
command needs a consumer on the tasks stream, which a busy server can refuse."""

from __future__ import annotations

import json

import pytest
from nats.js import api

from tests.helpers import cli, client, worker_env
from worker.nats.subjects import result_subject

pytestmark = pytest.mark.integration
URIS = ["s3://bucket/a.jpg", "s3://bucket/b.jpg", "s3://bucket/c.jpg", "s3://bucket/d.jpg"]


def test_a_repeated_submit_says_how_many_tasks_the_stream_dropped_as_duplicates(
    nats_server, settings_for
):
    settings = settings_for(nats_server.url)
    env = worker_env(settings)
    assert cli("provision", env=env).returncode == 0
    first = cli("submit", "--job", "job-again", *URIS[:2], env=env)
    assert first.returncode == 0, first.stderr
    # When the job is submitted again with two more images
    again = cli("submit", "--job", "job-again", *URIS, env=env)
    # Then it says two are new and two were dropped by the stream, not "submitted 4"
    assert again.returncode == 0, again.stderr
    assert "submitted 2 tasks for job job-again" in again.stdout, again.stdout
    assert "2 more dropped by the stream as already submitted" in again.stdout, again.stdout


def ok_result(job: str, task: str, **extra: object) -> bytes:
    return json.dumps({"task_id": task, "job_id": job, "status": "ok", **extra}).encode()


async def test_results_and_watch_count_only_the_jobs_tasks_and_only_readable_responses(
    nats_server, settings_for
):
    settings = settings_for(nats_server.url)
    env = worker_env(settings)
    assert cli("provision", env=env).returncode == 0
    assert cli("submit", "--job", "job-count", *URIS[:2], env=env).returncode == 0
    # Given one readable ok, one ok whose response object is gone, and one result of a task
    # the job never had (a client may publish on results.<job>.>)
    lost = {"bucket": settings.nats.result_objects, "name": "gone", "sha256": "0" * 64}
    async with client(settings) as js:
        for task, body in (
            (URIS[0], ok_result("job-count", URIS[0], response={"x": 1})),
            (URIS[1], ok_result("job-count", URIS[1], response_object=lost)),
            ("no-such-task", ok_result("job-count", "no-such-task", response={"x": 2})),
        ):
            await js.publish(result_subject("job-count", task), body)
    # When the job's results are read, and the job watched
    shown = cli("results", "--job", "job-count", env=env)
    watched = cli("watch", "--job", "job-count", "--timeout-s", "10", env=env)
    # Then one ok, one unreadable response, one foreign result: counted apart
    summary = "ok=1 error=0 missing=0 response_unreadable=1 foreign=1"
    assert shown.returncode == 0, shown.stderr
    assert summary in shown.stderr, shown.stderr
    assert "no-such-task" not in shown.stdout
    assert summary in watched.stderr, watched.stderr
    assert watched.returncode == 10, watched.stderr  # an unreadable response is no ok


async def test_results_and_watch_need_no_consumer_on_a_tasks_stream_at_its_limit(
    nats_server, settings_for
):
    settings = settings_for(nats_server.url)
    env = worker_env(settings)
    n = settings.nats
    assert cli("provision", env=env).returncode == 0
    async with client(settings) as js:
        # Given a tasks stream whose consumers are all taken (a busy fleet's job consumers)
        info = await js.stream_info(n.tasks_stream)
        info.config.max_consumers = info.state.consumer_count + 1
        await js.update_stream(info.config)
        await js.add_consumer(n.tasks_stream, api.ConsumerConfig(durable_name="other-job"))
    assert cli("submit", "--job", "job-busy", *URIS[:2], env=env).returncode == 0
    async with client(settings) as js:
        await js.publish(result_subject("job-busy", URIS[0]), ok_result("job-busy", URIS[0]))
    # When the job's results are read and the job watched
    shown = cli("results", "--job", "job-busy", env=env)
    watched = cli("watch", "--job", "job-busy", "--timeout-s", "3", env=env)
    # Then both know the job's two tasks without a consumer of their own on that stream
    for done in (shown, watched):
        assert "Traceback" not in done.stderr, done.stderr
        assert "ok=1 error=0 missing=1" in done.stderr, done.stderr
    assert shown.returncode == 0 and watched.returncode == 11
