"""In-process recovery: a loader child stopped mid-job, or a batch lost by the feeder thread."""

from __future__ import annotations

import asyncio
import os
import signal

import psutil
import pytest

from config.faults import FaultSettings
from tests.helpers import client, consumer_idle, running_worker, submit, upload_images, wait_results

pytestmark = pytest.mark.integration


def loader_restarts(app) -> float:
    value = app.worker.services.metrics.registry.get_sample_value(
        "inference_worker_loader_restarts_total"
    )
    return float(value or 0.0)


async def test_a_loader_child_stopped_mid_job_is_recovered_and_every_task_ends_ok(
    nats_server, s3_server, bucket, settings_for
):
    settings = settings_for(
        nats_server.url,
        nats={"max_deliver": 2, "nak_backoff_base_s": 0.1},
        loader={"timeout_s": 5, "batch_size": 4},
        s3={"connect_timeout_s": 1, "read_timeout_s": 1, "max_attempts": 1},
    )
    uris = upload_images(s3_server.client(), bucket, 16)
    async with running_worker(settings) as app, client(settings) as js:
        first_pids = app.engine.loader.child_pids()
        stopped = first_pids[0]
        os.kill(stopped, signal.SIGSTOP)
        for _ in range(100):  # let the stop take effect before the job starts
            if psutil.Process(stopped).status() == psutil.STATUS_STOPPED:
                break
            await asyncio.sleep(0.05)
        await submit(js, settings, "job-stopped-child", uris)
        results = await wait_results(js, settings, "job-stopped-child", 16, timeout_s=90)
        await consumer_idle(js, settings)
        restarts = loader_restarts(app)
        pids_after = app.engine.loader.child_pids()

    assert {r["status"] for r in results} == {"ok"}
    assert len({r["task_id"] for r in results}) == 16
    assert max(r["attempt"] for r in results) <= 2
    assert restarts >= 1
    assert stopped not in pids_after
    assert not psutil.pid_exists(stopped), "the stopped child was killed and reaped"


async def test_a_batch_dropped_by_the_feeder_thread_is_detected_by_the_timeout_and_recovered(
    nats_server, s3_server, bucket, settings_for, tmp_path
):
    settings = settings_for(
        nats_server.url,
        nats={"max_deliver": 2, "nak_backoff_base_s": 0.1},
        loader={"timeout_s": 5, "batch_size": 4},
        s3={"connect_timeout_s": 1, "read_timeout_s": 1, "max_attempts": 1},
    )
    faults = FaultSettings(drop_once_file=str(tmp_path / "drop-once"))
    uris = upload_images(s3_server.client(), bucket, 8)
    async with running_worker(settings, faults) as app, client(settings) as js:
        before = app.engine.loader.child_pids()
        await submit(js, settings, "job-dropped", uris)
        results = await wait_results(js, settings, "job-dropped", 8, timeout_s=90)
        await consumer_idle(js, settings)
        after = app.engine.loader.child_pids()
        restarts = loader_restarts(app)

    assert (tmp_path / "drop-once").exists(), "the fault hook fired"
    assert {r["status"] for r in results} == {"ok"}
    assert restarts == 1
    assert set(before).isdisjoint(after), "the loader was rebuilt with fresh children"
    assert any(r["attempt"] == 2 for r in results), "the lost image's task was given back"
    await asyncio.sleep(0)
