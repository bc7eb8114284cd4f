"""New jobs are served when their first task is published, not at the next job discovery:
the worker hears of published tasks (worker/nats/hints.py). Here discovery runs every 60 s,
so each job below would wait up to a minute without the hint; the test allows 20 s."""

from __future__ import annotations

import asyncio

import pytest

from tests.helpers import client, quiescent, running_worker, upload_images, wait_results
from worker.commands.job_client import job_results, make_tasks, publish_tasks

pytestmark = pytest.mark.integration
WITHOUT_HINT_S = 60.0
ALLOWED_S = 20.0


async def test_jobs_published_to_an_idle_and_to_a_busy_worker_are_heard_of_and_served(
    nats_server, s3_server, bucket, settings_for
):
    settings = settings_for(nats_server.url, nats={"job_discovery_s": WITHOUT_HINT_S})
    uris = upload_images(s3_server.client(), bucket, 4)
    pipeline = settings.model.pipeline
    async with running_worker(settings), client(settings) as js:
        await asyncio.sleep(1.0)  # the start's discovery is over: the worker is idle
        for n in range(2):  # each published to a worker with nothing to do
            await publish_tasks(js, settings.nats, pipeline, make_tasks(f"job-idle-{n}", uris[:1]))
            (result,) = await wait_results(js, settings, f"job-idle-{n}", 1, timeout_s=ALLOWED_S)
            assert result["status"] == "ok"

        big = uris * 30  # 120 tasks, still running when the small job comes
        await publish_tasks(js, settings.nats, pipeline, make_tasks("job-big", big))
        await wait_results(js, settings, "job-big", 1, timeout_s=ALLOWED_S)
        await publish_tasks(js, settings.nats, pipeline, make_tasks("job-small", uris[:2]))
        small = await wait_results(js, settings, "job-small", 2, timeout_s=ALLOWED_S)
        big_then = len(await job_results(js, settings.nats, "job-big"))
        await wait_results(js, settings, "job-big", len(big), timeout_s=300)
        await quiescent(js, settings)
    assert {r["status"] for r in small} == {"ok"}
    assert big_then < len(big), "the small job was served only after the big one"
