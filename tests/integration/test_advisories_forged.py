"""Max-deliveries advisories that a client forges are not acted on across consumers: one that
names another job's consumer (which delivered past the task), and one for a task delivered
once and still in flight, store no result for it (worker/nats/advisories.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from nats.js.errors import NotFoundError

from tests.helpers import client, submit
from worker.nats.advisories import MAX_DELIVER_TYPE, ExhaustedTasks
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

pytestmark = pytest.mark.integration


@contextlib.asynccontextmanager
async def advisory_handler(js: Any, settings: Any) -> AsyncIterator[None]:
    n = settings.nats
    settler = nats_settler(js, n, result_store(js, n), settings.model.pipeline)
    stop = asyncio.Event()
    exhausted = ExhaustedTasks(js, consumer_names(n), settler, fetch_timeout_s=n.fetch_timeout_s)
    handler = asyncio.create_task(exhausted.run(stop))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(handler, 10)


async def forge(js: Any, settings: Any, consumer: str, seq: int) -> None:
    n = settings.nats
    advisory = {
        "type": MAX_DELIVER_TYPE,
        "stream": n.tasks_stream,
        "consumer": consumer,
        "stream_seq": seq,
        "deliveries": n.max_deliver,
    }
    await js.publish(advisory_subject(consumer_names(n)), json.dumps(advisory).encode())


async def advisories_settled(js: Any, settings: Any, timeout_s: float = 20.0) -> None:
    n = settings.nats
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = await js.consumer_info(n.advisory_stream, advisory_consumer(consumer_names(n)))
        if info.num_pending == 0 and info.num_ack_pending == 0:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the advisories were never settled")


async def job_consumer_of(js: Any, settings: Any, job: str) -> Any:
    """The job's consumer as a worker makes it, bound; its subject."""
    n = settings.nats
    subject = job_tasks_subject(settings.model.pipeline, subject_token(job))
    await js.add_consumer(n.tasks_stream, job_consumer_config(n, subject))
    durable = job_consumer(consumer_names(n), subject)
    return await js.pull_subscribe_bind(durable=durable, stream=n.tasks_stream)


async def test_an_advisory_naming_another_jobs_consumer_fails_no_task(nats_server, settings_for):
    settings = settings_for(nats_server.url)
    n = settings.nats
    async with client(settings) as js:
        await provision(js, n, settings.model.pipeline)
        # Given a task queued and never delivered, and another job's task after it, delivered
        (victim,) = await submit(js, settings, "job-victim", ["s3://b/victim.jpg"])
        victim_seq = (await js.stream_info(n.tasks_stream)).state.last_seq
        await submit(js, settings, "job-other", ["s3://b/other.jpg"])
        other = await job_consumer_of(js, settings, "job-other")
        (delivered,) = await other.fetch(1, timeout=5)
        await delivered.ack()
        other_name = (await other.consumer_info()).name
        # When a client forges an advisory for the victim naming the other job's consumer
        await forge(js, settings, other_name, victim_seq)
        async with advisory_handler(js, settings):
            await advisories_settled(js, settings)
        # Then the victim has no result: it is still queued, for a worker to serve
        with pytest.raises(NotFoundError):
            await js.get_last_msg(n.results_stream, result_subject(victim.job_id, victim.id))
        await other.unsubscribe()


async def test_an_advisory_for_a_task_in_flight_does_not_win_over_its_result(
    nats_server, settings_for
):
    settings = settings_for(nats_server.url)
    n = settings.nats
    async with client(settings) as js:
        await provision(js, n, settings.model.pipeline)
        # Given a task delivered once and still in flight on its job's consumer
        (task,) = await submit(js, settings, "job-inflight", ["s3://b/inflight.jpg"])
        seq = (await js.stream_info(n.tasks_stream)).state.last_seq
        sub = await job_consumer_of(js, settings, "job-inflight")
        (held,) = await sub.fetch(1, timeout=5)
        assert held.metadata.num_delivered == 1
        name = (await sub.consumer_info()).name
        # When a client forges an advisory for it, and the handler reads it (and reads it
        # again later)
        await forge(js, settings, name, seq)
        async with advisory_handler(js, settings):
            deadline = time.monotonic() + 20
            while (
                await js.consumer_info(n.advisory_stream, advisory_consumer(consumer_names(n)))
            ).num_redelivered < 1:
                stored = await _stored(js, n, task)
                assert stored is None, f"the forged advisory stored {stored}"
                assert time.monotonic() < deadline, "the advisory was never read again"
                await asyncio.sleep(0.05)
            # Then nothing was stored meanwhile; the worker's ok lands and stands
            assert await _stored(js, n, task) is None
            ok = {"task_id": task.id, "job_id": task.job_id, "status": "ok"}
            await js.publish(result_subject(task.job_id, task.id), json.dumps(ok).encode())
            await held.ack()
            await advisories_settled(js, settings)
        assert (await _stored(js, n, task) or {}).get("status") == "ok"
        await sub.unsubscribe()


async def _stored(js: Any, n: Any, task: Any) -> dict[str, Any] | None:
    try:
        msg = await js.get_last_msg(n.results_stream, result_subject(task.job_id, task.id))
    except NotFoundError:
        return None
    return dict(json.loads(msg.data))
