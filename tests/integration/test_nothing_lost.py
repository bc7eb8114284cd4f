"""Nothing lost: exhausted deliveries, resource guards, and a drain on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import psutil
import pytest

from tests.helpers import (
    client,
    consumer_idle,
    quiescent,
    running_worker,
    submit,
    take_back,
    until_gone,
    upload_images,
    wait_results,
    worker_env,
    worker_process,
)
from worker.commands.job_client import job_results
from worker.nats.connection import connect
from worker.nats.feed import TaskFeed
from worker.nats.provision import provision

pytestmark = pytest.mark.integration


def short_ack_settings(settings_for, url, **groups):
    """A 3 s ack wait, with every other timeout tightened to fit under it."""
    return settings_for(
        url,
        nats={
            "ack_wait_s": 3,
            "max_deliver": 2,
            "fetch_timeout_s": 0.3,
            "store_retry_s": 1,
            **groups.pop("nats", {}),
        },
        loader={"timeout_s": 1.5},
        s3={"connect_timeout_s": 0.3, "read_timeout_s": 0.4, "max_attempts": 1},
        health={
            "stall_timeout_s": 2,
            "drain_timeout_s": 1,
            "warm_pass": False,
        },  # tight budgets: no warm pass
        **groups,
    )


async def test_a_task_whose_last_delivery_died_with_its_worker_still_gets_one_error_result(
    nats_server, s3_server, bucket, settings_for
):
    settings = short_ack_settings(settings_for, nats_server.url)
    uris = upload_images(s3_server.client(), bucket, 3)
    nc = await connect(settings.nats, give_up_after_s=30)
    js = nc.jetstream()
    await provision(js, settings.nats, settings.model.pipeline)
    [doomed] = await submit(js, settings, "job-exhausted", uris[:1])
    # Two workers take the task in turn and die holding it: nobody acks, nobody naks.
    feed = TaskFeed(nc, settings.nats, [settings.model.pipeline])
    await feed.open()
    delivered = []
    for _ in range(2):
        msgs = []
        for _ in range(20):
            msgs = await feed.fetch(1)
            if msgs:
                break
        delivered.append(msgs[0].metadata.num_delivered)
    await feed.close()
    assert delivered == [1, 2]

    async with running_worker(settings):
        others = await submit(js, settings, "job-exhausted-others", uris[1:])
        [result] = await wait_results(js, settings, "job-exhausted", 1, timeout_s=30)
        await wait_results(js, settings, "job-exhausted-others", len(others))
        await quiescent(js, settings)
        again = await job_results(js, settings.nats, "job-exhausted")
    await nc.close()

    assert result["task_id"] == doomed.id
    assert result["status"] == "error"
    assert result["error"]["type"] == "deliveries_exhausted"
    assert "deliveries ran out" in result["error"]["message"]
    assert result["attempt"] == 2
    assert len(again) == 1


async def test_crossing_a_resource_limit_drains_the_worker_and_loses_nothing(
    nats_server, s3_server, bucket, settings_for
):
    limited = settings_for(nats_server.url, guards={"max_tree_rss_bytes": 1, "check_interval_s": 0})
    uris = upload_images(s3_server.client(), bucket, 12)
    async with client(limited) as js:
        from worker.process.app import Assembly

        app = Assembly(limited)
        try:
            await app.start()
            tasks = await submit(js, limited, "job-guarded", uris)
            await asyncio.wait_for(app.run(asyncio.Event()), 60)  # it stops by itself
        finally:
            await app.close()
        assert app.worker is not None and "MAX_TREE_RSS_BYTES" in app.worker.exit.detail
        done_first = await job_results(js, limited.nats, "job-guarded")
        # A fresh process (no limit) takes what was given back.
        async with running_worker(settings_for(nats_server.url)):
            results = await wait_results(js, limited, "job-guarded", len(tasks))
            await consumer_idle(js, limited)

    assert 0 < len(done_first) < len(tasks), "the batch in hand finished, the rest was given back"
    assert sorted(r["task_id"] for r in results) == sorted(t.id for t in tasks)
    assert {r["status"] for r in results} == {"ok"}


async def test_sigterm_mid_job_finishes_the_batch_gives_back_the_rest_and_exits_0(
    nats_server, s3_server, bucket, settings_for, tmp_path
):
    from testing.shapednet import Shape, ShapedProxy

    settings = settings_for(nats_server.url)
    uris = upload_images(s3_server.client(), bucket, 40)
    log_path = tmp_path / "worker.log"
    # Every read takes 0.2 s, one at a time per child: the job lasts seconds, so the signal
    # lands in the middle of it however fast the machine decodes.
    slow = Shape(first_byte_median_s=0.2, first_byte_p99_s=0.2, bytes_per_s=0.0)
    async with client(settings) as js:
        await provision(js, settings.nats, settings.model.pipeline)
        with (
            ShapedProxy(s3_server.port, slow) as proxy,
            worker_process(
                worker_env(
                    settings,
                    WORKER_METRICS__PORT="0",
                    WORKER_S3__ENDPOINT_URL=proxy.url,
                    WORKER_LOADER__BATCH_SIZE="4",
                    WORKER_LOADER__PREFETCH_BATCHES="4",
                    WORKER_LOADER__READS_PER_WORKER="1",
                    WORKER_HEALTH__DRAIN_TIMEOUT_S="20",
                ),
                log_path,
            ) as proc,
        ):
            tasks = await submit(js, settings, "job-sigterm", uris)
            await wait_results(js, settings, "job-sigterm", 4, timeout_s=60)
            tree = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(proc.wait, 30)
        partial = await job_results(js, settings.nats, "job-sigterm")
        given_back = await take_back(
            js, settings, "job-sigterm", len(tasks) - len(partial), hand_on=True
        )
        async with running_worker(settings):
            results = await wait_results(js, settings, "job-sigterm", len(tasks))
            await consumer_idle(js, settings)

    log = log_path.read_text()
    assert code == 0, log[-3000:]
    assert "tasks_given_back" in log
    assert len(partial) < len(tasks)
    # Given back with nak, not left to time out: every unfinished task can be fetched at
    # once (in seconds, not after the 300 s ack wait).
    assert len(given_back) == len(tasks) - len(partial)
    assert until_gone(tree) == []
    assert sorted(r["task_id"] for r in results) == sorted(t.id for t in tasks)
    # At most: the drained worker's delivery, this test's take-back, the next worker's.
    assert max(r["attempt"] for r in results) <= 3


async def test_a_drain_that_runs_out_mid_settle_acks_or_gives_back_every_task_and_says_which(
    nats_server, s3_server, bucket, settings_for, tmp_path
):
    """Each result takes 10 s to store and the drain has 1 s: the SIGTERM lands while two
    batches are being settled. No task may be left for its ack wait (300 s): each one held is
    acked with its result stored, or given back at once, and its line says which. (The stores
    are long so that, however slowly a busy runner starts the second batch's, none of the
    first batch's ends just as the drain's time runs out: a result stored whose store's reply
    the cancel beats is then given back too, and would count as both.)"""
    settings = settings_for(nats_server.url)
    uris = upload_images(s3_server.client(), bucket, 16)
    log_path = tmp_path / "worker.log"
    async with client(settings) as js:
        await provision(js, settings.nats, settings.model.pipeline)
        env = worker_env(
            settings,
            WORKER_METRICS__PORT="0",
            WORKER_LOADER__BATCH_SIZE="4",
            WORKER_FAULTS__SLOW_STORE_S="10",
            WORKER_HEALTH__DRAIN_TIMEOUT_S="1",
        )
        with worker_process(env, log_path) as proc:
            tasks = await submit(js, settings, "job-drain-settles", uris)
            deadline = time.monotonic() + 120
            # Two batches' settles under way (4 slow writes each), the third batch next.
            while log_path.read_text().count("fault_hook_slow_result_store") < 8:
                assert proc.poll() is None, log_path.read_text()[-3000:]
                assert time.monotonic() < deadline, log_path.read_text()[-3000:]
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(proc.wait, 30)
        stored = {r["task_id"] for r in await job_results(js, settings.nats, "job-drain-settles")}
        # Given back with nak, so they come at once; none is left for its ack wait.
        given_back = await take_back(
            js, settings, "job-drain-settles", len(tasks) - len(stored), hand_on=True
        )

    log = log_path.read_text()
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    done = {line["task_id"] for line in lines if line.get("event") == "task_done"}
    said_given_back = {
        task_id
        for line in lines
        if line.get("event") == "tasks_given_back"
        for task_id in line.get("task_ids", [])
    }
    all_ids = {t.id for t in tasks}
    assert code == 0, log[-3000:]
    assert {json.loads(m.data)["id"] for m in given_back} == all_ids - stored, log[-3000:]
    assert done == stored, "each task acked says so, with its result stored"
    assert said_given_back == all_ids - stored, "each task given back says so"


async def test_the_watchdog_does_not_end_a_drain_that_is_within_its_time(
    nats_server, s3_server, bucket, settings_for, tmp_path
):
    """The last batch ran 11 s before the SIGTERM and its result store would take 60 s;
    nothing feeds the watchdog meanwhile. The drain (13 s) is shorter than the watchdog (20 s),
    but it ends 24 s after the batch: the watchdog's window starts over at the stop, so the
    drain gives back the tasks and the process exits 0, not with the watchdog's thread dump.

    Each way, seconds to spare on a busy runner: the SIGTERM comes 9 s before the watchdog
    would fire, the drain ends 7 s before a window started at the stop runs out, and without
    that restart the watchdog would fire 4 s before the drain ends."""
    settings = settings_for(nats_server.url)
    uris = upload_images(s3_server.client(), bucket, 4)
    log_path = tmp_path / "worker.log"
    async with client(settings) as js:
        await provision(js, settings.nats, settings.model.pipeline)
        env = worker_env(
            settings,
            WORKER_METRICS__PORT="0",
            WORKER_LOADER__BATCH_SIZE="4",
            WORKER_LOADER__TIMEOUT_S="1.5",
            WORKER_S3__CONNECT_TIMEOUT_S="0.3",
            WORKER_S3__READ_TIMEOUT_S="0.4",
            WORKER_S3__MAX_ATTEMPTS="1",
            WORKER_HEALTH__STALL_TIMEOUT_S="2",
            WORKER_HEALTH__WARM_PASS="false",
            WORKER_HEALTH__WATCHDOG_TIMEOUT_S="20",
            WORKER_HEALTH__DRAIN_TIMEOUT_S="13",
            WORKER_FAULTS__SLOW_STORE_S="60",
        )
        with worker_process(env, log_path) as proc:
            tasks = await submit(js, settings, "job-drain-watchdog", uris)
            deadline = time.monotonic() + 120
            while _tasks_run(log_path) < len(tasks):  # the last batch's end: t0
                assert proc.poll() is None, log_path.read_text()[-3000:]
                assert time.monotonic() < deadline, log_path.read_text()[-3000:]
                await asyncio.sleep(0.1)
            await asyncio.sleep(11)
            assert proc.poll() is None, log_path.read_text()[-3000:]
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(proc.wait, 30)
        log = log_path.read_text()
        assert "Timeout (0:00:20)!" not in log, log[-3000:]  # the watchdog's thread dump
        assert code == 0, log[-3000:]
        given_back = await take_back(js, settings, "job-drain-watchdog", len(tasks))

    assert len(given_back) == len(tasks), "given back at the drain's end, not left to time out"


def _tasks_run(log_path) -> int:
    """The tasks of the batches the worker's log says were run (its whole lines only)."""
    text = log_path.read_text()
    lines = [json.loads(x) for x in text.splitlines() if x.startswith("{") and x.endswith("}")]
    return sum(line["size"] for line in lines if line.get("event") == "batch_done")
