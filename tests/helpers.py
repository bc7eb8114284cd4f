"""Scenario helpers: upload images, run a worker in-process, wait for results (bounded)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from datasets.synthetic import image_bytes
from worker.app import WorkerApp
from worker.client import job_results, make_tasks, publish_tasks
from worker.schemas import Task
from worker.transport import connect

SIZES = [(640, 480), (1920, 1080), (300, 500), (1280, 720)]


def upload_images(s3: Any, bucket: str, count: int, prefix: str = "img") -> list[str]:
    uris = []
    for i in range(count):
        width, height = SIZES[i % len(SIZES)]
        key = f"{prefix}/{i:04d}.jpg"
        s3.put_object(Bucket=bucket, Key=key, Body=image_bytes(width, height, seed=i))
        uris.append(f"s3://{bucket}/{key}")
    return uris


@asynccontextmanager
async def running_worker(settings: Any) -> AsyncIterator[WorkerApp]:
    """A started worker, working in the background; drained and closed on exit."""
    app = WorkerApp(settings)
    await app.start()
    stop = asyncio.Event()
    task = asyncio.create_task(app.run(stop))
    try:
        yield app
    finally:
        stop.set()
        try:
            await asyncio.wait_for(task, 30)
        finally:
            await app.close()


@asynccontextmanager
async def client(settings: Any) -> AsyncIterator[Any]:
    nc = await connect(settings.nats, name="test-client")
    try:
        yield nc.jetstream()
    finally:
        await nc.close()


async def submit(js: Any, settings: Any, job_id: str, uris: list[str]) -> list[Task]:
    tasks = make_tasks(job_id, uris)
    await publish_tasks(js, settings.nats, settings.model.pipeline, tasks)
    return tasks


async def publish_raw(js: Any, settings: Any, payload: Any) -> None:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    await js.publish(f"tasks.{settings.model.pipeline}", data, stream=settings.nats.tasks_stream)


async def wait_results(
    js: Any, settings: Any, job_id: str, count: int, timeout_s: float = 60.0
) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    results: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        results = await job_results(js, settings.nats, job_id)
        if len(results) >= count:
            return results
        await asyncio.sleep(0.2)
    raise AssertionError(f"job {job_id}: {len(results)} of {count} results after {timeout_s}s")


async def consumer_idle(js: Any, settings: Any, timeout_s: float = 15.0) -> Any:
    """Wait until the durable consumer has nothing pending and nothing awaiting ack."""
    deadline = time.monotonic() + timeout_s
    info = None
    while time.monotonic() < deadline:
        info = await js.consumer_info(settings.nats.tasks_stream, settings.nats.consumer)
        if info.num_pending == 0 and info.num_ack_pending == 0:
            return info
        await asyncio.sleep(0.2)
    raise AssertionError(
        f"consumer still busy: pending={info.num_pending} ack_pending={info.num_ack_pending}"
    )
