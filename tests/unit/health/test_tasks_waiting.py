"""Tasks waiting on Antenna, as /metrics says it (``inference_worker_tasks_waiting{pipeline}``),
read from the fake Antenna over HTTP: its active jobs' remaining images per served pipeline,
each job once, not known (absent) while Antenna does not answer, 0 once the jobs are done."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr

from tests.antenna_fake import FakeAntenna
from worker.antenna.client import AntennaClient
from worker.antenna.waiting import antenna_waiting_read
from worker.health.tasks_waiting import TasksWaiting

TOKEN = "fake-token-0123456789abcdef"
OTHER = "other-token-0123456789abcdef"  # not a superuser's: Antenna lists each job twice


@pytest.fixture
def fake() -> Iterator[FakeAntenna]:
    antenna = FakeAntenna(token=TOKEN)
    antenna.tokens[OTHER] = {1}
    with antenna.running():
        yield antenna


def images(n: int, prefix: str) -> list[tuple[str, str]]:
    return [(f"{prefix}{i}", f"http://127.0.0.1:1/{prefix}{i}.jpg") for i in range(n)]


def exported(registry: CollectorRegistry) -> dict[str, dict[str, float]]:
    text = generate_latest(registry).decode()
    return {
        family.name: {s.labels.get("pipeline", ""): s.value for s in family.samples}
        for family in text_string_to_metric_families(text)
    }


async def fail_images(client: AntennaClient, job: int, count: int) -> None:
    """Reserve ``count`` tasks of ``job`` and post an error result for each: Antenna
    processes them (failed images count as processed)."""
    reserved = await client.post(
        f"jobs/{job}/tasks/", "tasks", json.dumps({"batch_size": count}).encode()
    )
    results = [
        {"reply_subject": t["reply_subject"], "result": {"error": "x", "image_id": t["image_id"]}}
        for t in reserved.body["tasks"]
    ]
    assert (
        await client.post(
            f"jobs/{job}/result/", "result", json.dumps({"results": results}).encode()
        )
    ).ok


async def test_antenna_tasks_waiting_per_pipeline_from_its_job_listing(fake):
    moths_a = fake.add_job("moths", images(4, "a"))
    moths_b = fake.add_job("moths", images(2, "b"))
    orders = fake.add_job("orders", images(3, "c"))
    fake.add_job("other", images(7, "d"))  # a pipeline this process does not serve
    fake.add_job("moths", images(5, "e"), status="SUCCESS")  # done: nothing waits
    client = AntennaClient(fake.url, SecretStr(OTHER), 5.0)
    waiting = TasksWaiting(antenna_waiting_read(client, ("moths", "orders"), 100), 30.0)
    registry = CollectorRegistry()
    registry.register(waiting)

    assert await waiting.read_once()
    seen = exported(registry)
    # Before any result Antenna says only what it collected: every image still to do.
    assert seen["inference_worker_tasks_waiting"] == {"moths": 6, "orders": 3}
    read_at = seen["inference_worker_tasks_waiting_read_timestamp_seconds"][""]

    admin = AntennaClient(fake.url, SecretStr(TOKEN), 5.0)
    await fail_images(admin, moths_a, 3)  # then the process stage's `remaining`
    assert await waiting.read_once()
    assert exported(registry)["inference_worker_tasks_waiting"] == {"moths": 3, "orders": 3}

    fake.misbehave("jobs", "html")  # a maintenance page: not an answer
    assert not await waiting.read_once()
    seen = exported(registry)
    assert "inference_worker_tasks_waiting" not in seen, "not known: absent, not a stale count"
    assert seen["inference_worker_tasks_waiting_read_timestamp_seconds"][""] >= read_at
    fake.behave()

    for job, count in ((moths_a, 1), (moths_b, 2), (orders, 3)):
        await fail_images(admin, job, count)
    assert await waiting.read_once()
    assert exported(registry)["inference_worker_tasks_waiting"] == {"moths": 0, "orders": 0}


async def test_a_read_that_hangs_is_given_up_and_the_gauge_is_absent() -> None:
    async def hangs() -> dict[str, int]:
        await asyncio.Event().wait()
        return {}

    waiting = TasksWaiting(hangs, 0.2)  # the read's bound: the interval, here
    registry = CollectorRegistry()
    registry.register(waiting)
    assert not await waiting.read_once()
    assert exported(registry) == {}, "never read: neither the gauge nor its timestamp"


def test_nats_counts_pending_per_pipeline_over_the_shared_and_job_consumers() -> None:
    """Not yet delivered only (ack-pending tasks are held or due again); the shared consumer
    of several pipelines under their joined names; other fleets' consumers left out."""
    from config.settings import NatsSettings
    from worker.nats.job_names import job_consumer
    from worker.nats.provision import consumer_names
    from worker.nats.waiting import waiting_by_pipeline

    n = consumer_names(NatsSettings(consumer="w"))

    def info(name: str, pending: int, subject: str = "", ack_pending: int = 0) -> Any:
        config = SimpleNamespace(filter_subject=subject)
        return SimpleNamespace(
            name=name, num_pending=pending, num_ack_pending=ack_pending, config=config
        )

    infos = [
        info("w", 4, ack_pending=9),
        info(job_consumer(n, "tasks.moths.j1"), 10, "tasks.moths.j1", ack_pending=5),
        info(job_consumer(n, "tasks.moths.j2"), 2, "tasks.moths.j2"),
        info(job_consumer(n, "tasks.orders.j3"), 7, "tasks.orders.j3"),
        info(job_consumer(n, "tasks.other.j4"), 50, "tasks.other.j4"),  # not served here
        info("w-new-jobs", 19),  # the same tasks' headers: not counted twice
        info("elsewhere-job-0123456789abcdef", 99, "tasks.moths.j9"),  # another fleet's
    ]
    assert waiting_by_pipeline(infos, n, ["moths"]) == {"moths": 4 + 10 + 2}
    assert waiting_by_pipeline(infos, n, ["moths", "orders"]) == {
        "moths": 12,
        "orders": 7,
        "moths,orders": 4,
    }
