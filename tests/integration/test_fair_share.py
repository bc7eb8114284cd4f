"""Fair share across jobs through the real worker and nats-server: a small job published
after a big one is served while the big one still runs (a consumer per job, fetched in
rotation), and nothing is lost or run twice."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.helpers import client, quiescent, running_worker, upload_images, wait_results
from worker.commands.job_client import job_results, make_tasks, publish_tasks

pytestmark = pytest.mark.integration

BIG, SMALL = 120, 5


async def _first_result(js, settings, job: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await job_results(js, settings.nats, job):
        assert time.monotonic() < deadline, f"job {job}: no result after {timeout_s}s"
        await asyncio.sleep(0.05)


async def _small_behind_big(settings, uris) -> tuple[int, list[dict], list[dict]]:
    """Publish the big job, wait for its first result, publish the small one; how many of the
    big job's results were stored when the small job's last one was."""
    async with running_worker(settings), client(settings) as js:
        pipeline = settings.model.pipeline
        await publish_tasks(
            js, settings.nats, pipeline, make_tasks("job-big", uris * (BIG // len(uris)))
        )
        await _first_result(js, settings, "job-big")
        await publish_tasks(js, settings.nats, pipeline, make_tasks("job-small", uris[:SMALL]))
        small = await wait_results(js, settings, "job-small", SMALL, timeout_s=120)
        big_then = len(await job_results(js, settings.nats, "job-big"))
        big = await wait_results(js, settings, "job-big", BIG, timeout_s=300)
        await quiescent(js, settings)
    return big_then, small, big


async def test_a_small_job_published_after_a_big_one_finishes_while_the_big_one_runs(
    nats_server, s3_server, bucket, settings_for
):
    settings = settings_for(
        nats_server.url,
        nats={"job_discovery_s": 0.2},
        loader={"batch_size": 4, "prefetch_batches": 2},
    )
    uris = upload_images(s3_server.client(), bucket, 8)
    big_then, small, big = await _small_behind_big(settings, uris)

    assert {r["status"] for r in small} == {"ok"} and {r["status"] for r in big} == {"ok"}
    assert len({r["task_id"] for r in big}) == BIG and len(big) == BIG  # none lost or twice
    # The small job ended before the big one was half done (in stream order it ends last).
    assert big_then < BIG // 2, f"{big_then} of {BIG} big-job results before the small job's last"


async def test_a_job_published_to_an_idle_worker_is_served_without_waiting_out_a_long_pull(
    nats_server, s3_server, bucket, settings_for
):
    """An idle worker waits on its durable consumer only until the next job discovery, not
    for a whole fetch timeout: with a 20 s pull each new job is still found at the next
    discovery (0.2 s) and answered well within the 10 s this test waits for it (before the
    fix each one waited out the pull in progress)."""
    settings = settings_for(nats_server.url, nats={"job_discovery_s": 0.2, "fetch_timeout_s": 20.0})
    uris = upload_images(s3_server.client(), bucket, 2)
    async with running_worker(settings), client(settings) as js:
        pipeline = settings.model.pipeline
        for n, uri in enumerate(uris):  # each job published to a worker with nothing to do
            await asyncio.sleep(0.5)
            await publish_tasks(js, settings.nats, pipeline, make_tasks(f"job-idle-{n}", [uri]))
            (result,) = await wait_results(js, settings, f"job-idle-{n}", 1, timeout_s=10)
            assert result["status"] == "ok"
        await quiescent(js, settings)
