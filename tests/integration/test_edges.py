"""The edges around a task, as an attacker or a careless operator meets them (issue 23): S3 keys
that look like URLs, a prefix submitted twice, forged advisories, malformed results, stream
limits, a metrics port already taken. Real nats-server and moto S3 throughout."""

from __future__ import annotations

import json
import socket

import pytest

from datasets.uris import SourceConfig, read_bytes
from tests.helpers import cli, client, submit, worker_env
from worker.commands.demo_images import image_bytes
from worker.commands.job_client import job_task_ids

pytestmark = pytest.mark.integration


def test_s3_keys_with_hash_or_question_mark_read_their_own_object(s3_server, bucket):
    # Given three objects whose keys differ only by what a URL parser would cut off
    s3 = s3_server.client()
    keys = ["trap/cat.jpg", "trap/cat.jpg#2", "trap/cat.jpg?v=2", "trap/100%25.jpg"]
    bodies = {key: image_bytes(64 + 16 * n, 48, seed=n) for n, key in enumerate(keys)}
    for key, body in bodies.items():
        s3.put_object(Bucket=bucket, Key=key, Body=body)
    config = SourceConfig(s3_endpoint_url=s3_server.endpoint_url, connect_timeout_s=2)
    # When each is read by its s3:// URI, then each gives its own bytes
    for key, body in bodies.items():
        assert read_bytes(f"s3://{bucket}/{key}", config) == body, key


async def test_submitting_a_prefix_again_queues_the_objects_added_since_and_nothing_twice(
    nats_server, s3_server, bucket, settings_for
):
    settings = settings_for(nats_server.url)
    env = worker_env(settings)
    s3 = s3_server.client()
    assert cli("provision", env=env).returncode == 0
    for key in ("job/a.jpg", "job/c.jpg"):
        s3.put_object(Bucket=bucket, Key=key, Body=image_bytes(32, 32, seed=1))
    first = cli("submit", "--job", "job-again", f"s3://{bucket}/job/", env=env)
    assert first.returncode == 0, first.stderr
    # An object arrives between the two submissions, sorting between the first two
    s3.put_object(Bucket=bucket, Key="job/b.jpg", Body=image_bytes(32, 32, seed=2))
    again = cli("submit", "--job", "job-again", f"s3://{bucket}/job/", env=env)
    assert again.returncode == 0, again.stderr
    async with client(settings) as js:
        info = await js.stream_info(settings.nats.tasks_stream)
        queued = await _task_urls(js, settings)
        ids = await job_task_ids(js, settings.nats, "job-again")
    assert sorted(queued) == [f"s3://{bucket}/job/{name}.jpg" for name in "abc"], (
        "each object queued once, b too"
    )
    assert info.state.messages == 3
    assert len(ids) == 3


async def _task_urls(js, settings) -> list[str]:
    from worker.commands.job_client import _read_all

    raw = await _read_all(js, settings.nats.tasks_stream, "tasks.>")
    return [json.loads(data)["image_url"] for data in raw]


def _taken_port() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock


async def test_messages_on_a_jobs_result_subjects_that_are_no_result_hide_no_result(
    nats_server, settings_for
):
    from worker.nats.subjects import result_subject

    settings = settings_for(nats_server.url)
    env = worker_env(settings)
    assert cli("provision", env=env).returncode == 0
    uris = ["s3://b/one.jpg", "s3://b/two.jpg"]
    async with client(settings) as js:
        tasks = await submit(js, settings, "job-junk", uris)
        for task in tasks:  # Given both tasks' results stored
            result = {"task_id": task.id, "job_id": task.job_id, "status": "ok", "response": {}}
            await js.publish(result_subject(task.job_id, task.id), json.dumps(result).encode())
        # And, among them, what a client published there: not UTF-8, an array, no task id
        for name, junk in (("bytes", b"\xff\xfe\x00"), ("array", b"[1, 2]"), ("bare", b"{}")):
            await js.publish(f"results.job-junk.{name}", junk)
    # When the job's results are listed, then both are, with the junk counted apart
    shown = cli("results", "--job", "job-junk", env=env)
    assert shown.returncode == 0, shown.stderr
    listed = [json.loads(line) for line in shown.stdout.splitlines()]
    assert sorted(r["task_id"] for r in listed) == sorted(t.id for t in tasks)
    assert "ok=2 error=0 missing=0 unreadable=3" in shown.stderr
    # When the job is watched, then it ends all ok, the junk counted apart
    watched = cli("watch", "--job", "job-junk", "--timeout-s", "20", env=env)
    assert watched.returncode == 0, watched.stderr
    assert "job job-junk: ok=2 error=0 missing=0 unreadable=3" in watched.stderr


async def test_a_forged_max_deliveries_advisory_fails_no_task(nats_server, settings_for):
    import asyncio

    from nats.js.errors import NotFoundError

    from worker.nats.advisories import ExhaustedTasks
    from worker.nats.job_consumers import job_consumer, job_consumer_config
    from worker.nats.parts import nats_settler, result_store
    from worker.nats.provision import consumer_names, provision
    from worker.nats.subjects import (
        advisory_consumer,
        advisory_subject,
        job_tasks_subject,
        result_subject,
        subject_token,
    )

    settings = settings_for(nats_server.url)
    n = settings.nats
    names = consumer_names(n)
    async with client(settings) as js:
        await provision(js, n, settings.model.pipeline)
        # Given a task queued and never delivered (no worker runs)
        (task,) = await submit(js, settings, "job-forged", ["s3://b/queued.jpg"])
        seq = (await js.stream_info(n.tasks_stream)).state.last_seq
        # When a client publishes advisories for it, bare and dressed as the server's
        dressed = {
            "type": "io.nats.jetstream.advisory.v1.max_deliver",
            "stream": n.tasks_stream,
            "consumer": n.consumer,
        }
        subject = job_tasks_subject(settings.model.pipeline, subject_token(task.job_id))
        as_its_job_consumer = {**dressed, "consumer": job_consumer(names, subject)}  # not made yet
        for advisory in ({}, dressed, as_its_job_consumer):
            payload = {**advisory, "stream_seq": seq, "deliveries": n.max_deliver}
            await js.publish(advisory_subject(names), json.dumps(payload).encode())
        # And the max-deliveries handler reads them
        settler = nats_settler(js, n, result_store(js, n), settings.model.pipeline)
        stop = asyncio.Event()
        exhausted = ExhaustedTasks(js, names, settler, fetch_timeout_s=n.fetch_timeout_s)
        handler = asyncio.create_task(exhausted.run(stop))
        try:
            for _ in range(200):
                info = await js.consumer_info(n.advisory_stream, advisory_consumer(names))
                if info.num_pending == 0 and info.num_ack_pending == 0:
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the advisories were never settled")
        finally:
            stop.set()
            await asyncio.wait_for(handler, 10)
        # Then the task has no result: it is still queued, for a worker to serve
        with pytest.raises(NotFoundError):
            await js.get_last_msg(n.results_stream, result_subject(task.job_id, task.id))
        # (the job's consumer, made as a worker finding the job makes it, has it pending)
        serving = await js.add_consumer(n.tasks_stream, job_consumer_config(n, subject))
    assert serving.num_pending == 1


async def test_a_full_tasks_stream_refuses_new_tasks_and_keeps_the_queued_ones(
    nats_server, settings_for
):
    settings = settings_for(nats_server.url, nats={"tasks_max_msgs": 3})
    env = worker_env(settings, WORKER_NATS__TASKS_MAX_MSGS="3")
    assert cli("provision", env=env).returncode == 0
    first = [f"s3://b/{n}.jpg" for n in range(3)]
    assert cli("submit", "--job", "job-full", *first, env=env).returncode == 0
    # When a submitter goes on past the limit
    more = cli("submit", "--job", "job-full", "s3://b/3.jpg", "s3://b/4.jpg", env=env)
    # Then it is told so in one line, and what was queued is still there
    assert more.returncode == 1
    assert [line for line in more.stderr.splitlines() if line.strip()] == [
        line for line in more.stderr.splitlines() if line.startswith("error: the tasks stream")
    ]
    async with client(settings) as js:
        info = await js.stream_info(settings.nats.tasks_stream)
        queued = await _task_urls(js, settings)
    assert info.config.max_msgs == 3
    assert sorted(queued) == first


def test_a_metrics_port_another_process_holds_ends_the_start_with_exit_2_and_one_line(
    nats_server, settings_for
):
    settings = settings_for(nats_server.url)
    with _taken_port() as taken:
        port = taken.getsockname()[1]
        done = cli("run", env=worker_env(settings, WORKER_METRICS__PORT=str(port)), timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert errors == [
        f"config error: WORKER_METRICS__PORT: cannot listen on 127.0.0.1:{port}: Address already "
        "in use (another process holds the port, or WORKER_METRICS__HOST is not this host's "
        "address)"
    ]
    assert "Traceback" not in done.stderr
    assert "worker_started" not in done.stderr and "provision" not in done.stderr
