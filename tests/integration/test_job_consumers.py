"""Job consumers over a week of jobs, through the real worker and nats-server: they are made
as jobs come and deleted as they finish, never more at once than the bound, and a server that
refuses more (its consumer limit filled by other clients) is a /healthz problem and a metric
until there is room again (worker/nats/lifecycle.py)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.js import api
from nats.js.errors import APIError, NotFoundError

from bench.common.sampling import sampled
from tests.helpers import client, running_worker
from worker.commands.demo_images import image_bytes
from worker.commands.job_client import make_tasks, publish_tasks
from worker.commands.localservers import find_nats_server, free_port, stop_process, wait_port
from worker.nats.subjects import result_subject

pytestmark = pytest.mark.integration

JOBS, WAVE = 3000, 150
BOUND = 100  # WORKER_NATS__MAX_JOB_CONSUMERS here
OTHERS = 2  # the shared consumer and the new-jobs one


def small_images(s3: Any, bucket: str, count: int) -> list[str]:
    uris = []
    for i in range(count):
        key = f"small/{i}.jpg"
        s3.put_object(Bucket=bucket, Key=key, Body=image_bytes(64, 48, seed=i))
        uris.append(f"s3://{bucket}/{key}")
    return uris


async def results_stored(js: Any, settings: Any) -> int:
    return int((await js.stream_info(settings.nats.results_stream)).state.messages)


@contextlib.asynccontextmanager
async def consumer_counts(js: Any, stream: str) -> AsyncIterator[list[int]]:
    """The stream's consumer count, sampled every 50 ms while inside (stopped by an event,
    not cancelled: ``bench.common.sampling`` says why)."""

    async def count() -> int:
        return int((await js.stream_info(stream)).state.consumer_count)

    async with sampled(count, every_s=0.05) as seen:
        yield seen


async def wait_until(what: str, check: Any, timeout_s: float, seen: list[int]) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert max(seen, default=0) <= BOUND + OTHERS, f"{max(seen)} consumers at once"
        assert time.monotonic() < deadline, f"{what} not within {timeout_s}s"
        await asyncio.sleep(0.1)


@pytest.mark.timeout(480)  # 64-118 s quiet on 2 cores, 258 s beside two busy loops (2026-12-03)
async def test_three_thousand_one_task_jobs_keep_the_consumers_bounded_and_serve_a_last_job(
    nats_server, s3_server, bucket, settings_for
):
    settings = settings_for(
        nats_server.url,
        nats={
            "job_discovery_s": 0.2,
            "job_consumer_linger_s": 0.5,
            "max_job_consumers": BOUND,
        },
        loader={"batch_size": 32, "prefetch_batches": 2},
    )
    uris = small_images(s3_server.client(), bucket, 4)
    pipeline, n = settings.model.pipeline, settings.nats
    async with running_worker(settings) as app, client(settings) as js:
        async with consumer_counts(js, n.tasks_stream) as seen:
            # Given 3,000 one-task jobs published over the run, one subject each (Antenna's)
            for wave in range(JOBS // WAVE):
                tasks = [
                    task
                    for j in range(wave * WAVE, (wave + 1) * WAVE)
                    for task in make_tasks(f"job-{j}", [uris[j % len(uris)]])
                ]
                await publish_tasks(js, n, pipeline, tasks)
                published = (wave + 1) * WAVE

                async def caught_up(behind: int = published - 2 * WAVE) -> bool:
                    return await results_stored(js, settings) >= behind

                await wait_until("the worker keeping up", caught_up, 120, seen)

            async def all_answered() -> bool:
                return await results_stored(js, settings) >= JOBS

            await wait_until("every job answered", all_answered, 180, seen)
            # Then a job published at the end is served still
            (last,) = make_tasks("job-last", uris[:1])
            await publish_tasks(js, n, pipeline, [last])
            started = time.monotonic()
            result = await _result(js, settings, last, timeout_s=20)
            served_s = time.monotonic() - started
        ok = app.registry.get_sample_value(
            "inference_worker_tasks_total", {"outcome": "ok", "pipeline": pipeline}
        )
        made = app.registry.get_sample_value("inference_worker_job_consumers_made_total")
    assert result["status"] == "ok", result
    assert ok == JOBS + 1  # each job answered, once
    assert max(seen) <= BOUND + OTHERS, f"{max(seen)} consumers at once"
    assert made is not None and made >= JOBS  # one consumer per job, each deleted after
    print(f"last job served in {served_s:.2f}s; most consumers at once {max(seen)}")


async def _result(js: Any, settings: Any, task: Any, timeout_s: float) -> dict[str, Any]:
    """The task's stored result (a direct read: no consumer, which a full server refuses)."""
    import json

    deadline = time.monotonic() + timeout_s
    subject = result_subject(task.job_id, task.id)
    while time.monotonic() < deadline:
        try:
            stored = await js.get_last_msg(settings.nats.results_stream, subject)
        except NotFoundError:
            await asyncio.sleep(0.1)
            continue
        return dict(json.loads(stored.data))
    raise AssertionError(f"no result for {task.id} within {timeout_s}s")


# -- a server whose consumer limit other clients fill --------------------------------------
ACCOUNT_MAX_CONSUMERS = 16


@contextlib.contextmanager
def limited_nats(tmp_path: Path) -> Iterator[str]:
    """A nats-server whose one account may hold ACCOUNT_MAX_CONSUMERS consumers."""
    port = free_port()
    conf = tmp_path / "limited.conf"
    conf.write_text(
        f"listen: 127.0.0.1:{port}\n"
        f'jetstream {{ store_dir: "{tmp_path / "js"}" }}\n'
        "accounts { LIMITED { jetstream { max_consumers: "
        f"{ACCOUNT_MAX_CONSUMERS} }}, users [{{ user: w, password: w }}] }} }}\n"
    )
    proc = subprocess.Popen(
        [find_nats_server(), "-c", str(conf), "-l", str(tmp_path / "nats.log")],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_port(port, proc, "nats-server")
        yield f"nats://w:w@127.0.0.1:{port}"
    finally:
        stop_process(proc)


def healthz(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


async def fill_consumers(url: str, stream: str) -> tuple[Any, list[str]]:
    """Another client's consumers on the tasks stream until the server refuses one."""
    nc = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=0)
    js = nc.jetstream()
    made: list[str] = []
    for i in range(ACCOUNT_MAX_CONSUMERS + 1):
        try:
            await js.add_consumer(
                stream, api.ConsumerConfig(durable_name=f"other-{i}", filter_subject="tasks.x")
            )
        except APIError:
            return nc, made
        made.append(f"other-{i}")
    raise AssertionError("the server never refused a consumer")


async def test_a_consumer_limit_filled_by_others_is_a_health_problem_until_there_is_room(
    tmp_path, s3_server, bucket, settings_for
):
    port = free_port()
    uris = small_images(s3_server.client(), bucket, 2)
    with limited_nats(tmp_path) as url:
        settings = settings_for(
            url,
            nats={"job_discovery_s": 0.2, "job_consumer_linger_s": 300},
            metrics={"port": port},
        )
        pipeline, n = settings.model.pipeline, settings.nats
        async with running_worker(settings) as app, client(settings) as js:
            (first,) = make_tasks("job-before", uris[:1])
            await publish_tasks(js, n, pipeline, [first])
            assert (await _result(js, settings, first, 30))["status"] == "ok"
            # Given another client's consumers filling the server's limit
            other, theirs = await fill_consumers(url, n.tasks_stream)
            try:
                # When a job comes
                (task,) = make_tasks("job-refused", uris[1:])
                await publish_tasks(js, n, pipeline, [task])
                # Then /healthz and the metric name the refusal
                deadline = time.monotonic() + 30
                while healthz(port)[0] == 200:
                    assert time.monotonic() < deadline, "/healthz still ok"
                    await asyncio.sleep(0.1)
                status, body = healthz(port)
                refused = app.registry.get_sample_value(
                    "inference_worker_job_consumers_refused_total"
                )
                # And once there is room, the job is served and /healthz is ok again
                for name in theirs:
                    await other.jetstream().delete_consumer(n.tasks_stream, name)
                result = await _result(js, settings, task, 30)
                deadline = time.monotonic() + 30
                while healthz(port)[0] != 200:
                    assert time.monotonic() < deadline, f"/healthz: {healthz(port)}"
                    await asyncio.sleep(0.1)
            finally:
                await other.close()
    assert status == 503 and "refused a job consumer" in body, body
    assert "maximum consumers limit reached" in body, body
    assert refused is not None and refused >= 1
    assert result["status"] == "ok"


# -- a task published as its job's consumer is deleted, the remake refused ------------------
class _PublishesBeforeTheDelete:
    """The deleting process's JetStream, with a task published on ``subject`` and another
    process's discovery (``meanwhile``) run just before the delete reaches the server: the
    race of a task published after the deleter's last look at the consumer."""

    def __init__(self, js: Any, subject: str, meanwhile: Any) -> None:
        self._js, self._subject, self._meanwhile = js, subject, meanwhile

    def __getattr__(self, name: str) -> Any:
        return getattr(self._js, name)

    async def delete_consumer(self, stream: str, name: str) -> Any:
        await self._js.publish(self._subject, b"{}", stream=stream)
        await self._meanwhile()
        return await self._js.delete_consumer(stream, name)


async def _job_consumers(js: Any, n: Any) -> dict[str, Any]:
    from worker.nats.job_consumers import is_job_consumer
    from worker.nats.provision import consumer_names

    infos = await js.consumers_info(n.tasks_stream)
    return {i.name: i for i in infos if is_job_consumer(consumer_names(n), i.name)}


async def test_a_task_published_as_its_consumer_is_deleted_is_served_after_both_processes_stop(
    nats_server, settings_for, monkeypatch
):
    from worker.nats.job_consumers import job_consumer, job_consumer_config, job_lifecycle
    from worker.nats.provision import consumer_names, provision
    from worker.nats.subjects import job_tasks_subject, subject_token

    settings = settings_for(nats_server.url, nats={"max_job_consumers": 1})
    n, pipeline = settings.nats, settings.model.pipeline
    quiet, busy = (job_tasks_subject(pipeline, subject_token(j)) for j in ("quiet", "busy"))
    async with client(settings) as js:
        # Given two job consumers at the bound of 1: a quiet job's and a busy one's
        await provision(js, n, pipeline)
        for subject in (quiet, busy):
            await js.add_consumer(n.tasks_stream, job_consumer_config(n, subject))
        await js.publish(busy, b"{}", stream=n.tasks_stream)
        other = job_lifecycle(js, n)
        await other.open()

        async def other_discovers() -> None:  # reads the task's new-jobs message, lists
            scouted = await other.scout()
            other.listed(await _job_consumers(js, n))
            await other.make_missing(scouted)

        # When the quiet one is deleted by a process, a task of its job published meanwhile
        # and heard of by another process, its remake refused (the bound)
        deleter = job_lifecycle(_PublishesBeforeTheDelete(js, quiet, other_discovers), n)
        await deleter.open()
        for _ in range(2):  # quiet at one discovery, deleted at the next (the bound: no linger)
            deleter.listed(await _job_consumers(js, n))
            await deleter.delete_finished(set())
        assert job_consumer(consumer_names(n), quiet) not in await _job_consumers(js, n)
        # And both processes stop (the deleter before its next discovery)
        await other.close()
        # Then the next process to start makes the job's consumer, which delivers the task,
        # within a few of its discoveries: the message the stopped process gave back comes
        # back to a short read, which a loaded machine may miss once (a discovery a third of
        # SCOUT_ACK_WAIT_S later reads again; here at once, bounded).
        monkeypatch.setattr("worker.nats.job_discovery.SCOUT_ACK_WAIT_S", 0.0)
        following = job_lifecycle(js, n.model_copy(update={"max_job_consumers": 4}))
        await following.open()
        for _ in range(10):
            scouted = await following.scout()
            following.listed(await _job_consumers(js, n))
            await following.make_missing(scouted)
            if job_consumer(consumer_names(n), quiet) in await _job_consumers(js, n):
                break
        await following.close()
        info = await js.consumer_info(n.tasks_stream, job_consumer(consumer_names(n), quiet))
    assert info.num_pending == 1


async def _two_quiet_jobs(js: Any, settings: Any) -> tuple[str, str]:
    """Two job consumers with no work, the bound 1 (so a quiet one is due at the next look)."""
    from worker.nats.job_consumers import job_consumer, job_consumer_config
    from worker.nats.provision import consumer_names, provision
    from worker.nats.subjects import job_tasks_subject, subject_token

    n, pipeline = settings.nats, settings.model.pipeline
    await provision(js, n, pipeline)
    names = []
    for job in ("first", "second"):
        subject = job_tasks_subject(pipeline, subject_token(job))
        await js.add_consumer(n.tasks_stream, job_consumer_config(n, subject))
        names.append(job_consumer(consumer_names(n), subject))
    return names[0], names[1]


async def test_an_advisory_waiting_holds_back_only_the_delete_of_the_consumer_it_names(
    nats_server, settings_for
):
    import json

    from worker.nats.advisories import MAX_DELIVER_TYPE
    from worker.nats.job_consumers import job_lifecycle
    from worker.nats.provision import consumer_names
    from worker.nats.subjects import consumer_advisory_subject

    settings = settings_for(nats_server.url, nats={"max_job_consumers": 1})
    n = settings.nats
    async with client(settings) as js:
        named, other = await _two_quiet_jobs(js, settings)
        # Given a max-deliveries advisory naming one of two finished jobs' consumers, not
        # yet handled
        advisory = {"type": MAX_DELIVER_TYPE, "stream": n.tasks_stream, "consumer": named}
        advisory |= {"stream_seq": 1, "deliveries": n.max_deliver}
        subject = consumer_advisory_subject(consumer_names(n), named)
        await js.publish(subject, json.dumps(advisory).encode())
        # When the lifecycle looks at them twice (quiet, then due)
        life = job_lifecycle(js, n)
        await life.open()
        for _ in range(2):
            life.listed(await _job_consumers(js, n))
            await life.delete_finished(set())
        left = await _job_consumers(js, n)
    # Then the other finished job's consumer is deleted, the named one kept for its advisory
    assert other not in left
    assert named in left


async def test_a_consumer_that_delivered_since_its_listing_is_not_deleted(
    nats_server, settings_for
):
    from worker.nats.job_consumers import job_lifecycle

    settings = settings_for(nats_server.url, nats={"max_job_consumers": 1})
    n = settings.nats
    async with client(settings) as js:
        busy, _ = await _two_quiet_jobs(js, settings)
        life = job_lifecycle(js, n)
        await life.open()
        # Given a listing of a quiet job consumer
        listed = await _job_consumers(js, n)
        life.listed(listed)
        await life.delete_finished(set())
        # When a task of it is published and fetched by a process with it bound
        subject = listed[busy].config.filter_subject
        await js.publish(subject, b"{}", stream=n.tasks_stream)
        sub = await js.pull_subscribe_bind(durable=busy, stream=n.tasks_stream)
        (task,) = await sub.fetch(1, timeout=5)
        # And the lifecycle acts on the earlier listing
        life.listed(listed)
        await life.delete_finished(set())
        left = await _job_consumers(js, n)
        # Then the consumer is kept, and the task's ack reaches it
        await task.ack_sync()
        info = await js.consumer_info(n.tasks_stream, busy)
        await sub.unsubscribe()
    assert busy in left
    assert info.num_ack_pending == 0 and info.num_redelivered == 0


class _ListingFailsOnce:
    """A JetStream whose first consumer listing times out."""

    def __init__(self, js: Any) -> None:
        self._js, self.failed = js, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._js, name)

    async def consumers_info(self, stream: str, offset: int = 0) -> Any:
        if not self.failed:
            self.failed = True
            raise TimeoutError("listing timed out")
        return await self._js.consumers_info(stream, offset=offset)


async def test_a_new_job_read_by_a_failed_discovery_gets_its_consumer_at_the_next(
    nats_server, settings_for
):
    from worker.nats.job_consumers import JobConsumers, job_consumer
    from worker.nats.provision import consumer_names, provision
    from worker.nats.subjects import job_tasks_subject, subject_token

    settings = settings_for(nats_server.url)
    n, pipeline = settings.nats, settings.model.pipeline
    subject = job_tasks_subject(pipeline, subject_token("job-after-a-failure"))
    async with client(settings) as js:
        await provision(js, n, pipeline)
        flaky = _ListingFailsOnce(js)
        jobs = JobConsumers(flaky, n, [pipeline])
        await jobs._life.open()
        # Given a new job's task, read by a discovery whose listing then fails
        await js.publish(subject, b"{}", stream=n.tasks_stream)
        await jobs.refresh()
        assert flaky.failed
        # When the next discovery runs
        await jobs.refresh()
        made = job_consumer(consumer_names(n), subject) in await _job_consumers(js, n)
        await jobs.close()
    # Then the job has its consumer (not only after the new-jobs ack wait of 30 s)
    assert made
