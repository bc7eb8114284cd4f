"""A worker against a real nats-server and a real HTTP S3 endpoint: normal path, bad input."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tests.conftest import LABELS
from tests.helpers import (
    client,
    consumer_idle,
    publish_raw,
    running_worker,
    submit,
    upload_images,
    wait_results,
)
from worker.commands.demo_images import corrupt_bytes
from worker.commands.job_client import job_results, make_tasks, publish_tasks

pytestmark = pytest.mark.integration


async def test_a_job_of_n_images_gives_n_ok_results_and_leaves_nothing_pending(
    nats_server, s3_server, bucket, settings_for, model_path
):
    settings = settings_for(nats_server.url)
    uris = upload_images(s3_server.client(), bucket, 10)
    async with running_worker(settings), client(settings) as js:
        tasks = await submit(js, settings, "job-normal", uris)
        results = await wait_results(js, settings, "job-normal", len(tasks))
        info = await consumer_idle(js, settings)

    assert sorted(r["task_id"] for r in results) == sorted(t.id for t in tasks)
    assert {r["status"] for r in results} == {"ok"}
    uris_by_id = {t.image_id: t.image_url for t in tasks}
    first = results[0]
    (detection,) = first["response"]["detections"]  # a classifier alone: the whole image
    assert detection["bbox"] is None and detection["source_image_id"] == first["image_id"]
    (classification,) = detection["classifications"]
    assert classification["labels"] == LABELS  # the full softmax vector, labels inline
    assert len(classification["scores"]) == len(LABELS)
    assert abs(sum(classification["scores"]) - 1.0) < 1e-4
    best = max(range(len(LABELS)), key=lambda i: classification["scores"][i])
    assert classification["classification"] == classification["labels"][best]
    assert first["response"]["source_images"] == [
        {"id": first["image_id"], "url": uris_by_id[first["image_id"]]}
    ]
    assert first["model"]["name"] == settings.model.pipeline
    assert len(first["model"]["weights_sha256"]) == 64
    assert first["attempt"] == 1 and first["worker"]["pid"] > 0
    assert info.num_redelivered == 0


async def test_bad_input_ends_as_the_spec_says_while_the_rest_of_the_job_completes(
    nats_server, s3_server, bucket, settings_for
):
    settings = settings_for(nats_server.url)
    s3 = s3_server.client()
    good = upload_images(s3, bucket, 5)
    s3.put_object(Bucket=bucket, Key="corrupt.jpg", Body=corrupt_bytes())
    s3.put_object(Bucket=bucket, Key="truncated.jpg", Body=b"\xff\xd8\xff\xe0\x00\x10JFIF")
    job = "job-bad"
    async with running_worker(settings), client(settings) as js:
        submitted = await submit(js, settings, job, good)
        await publish_raw(
            js,
            settings,
            {
                "id": "t-corrupt",
                "job_id": job,
                "image_id": "c",
                "image_url": f"s3://{bucket}/corrupt.jpg",
            },
        )
        await publish_raw(
            js,
            settings,
            {
                "id": "t-truncated",
                "job_id": job,
                "image_id": "tr",
                "image_url": f"s3://{bucket}/truncated.jpg",
            },
        )
        await publish_raw(
            js,
            settings,
            {
                "id": "t-missing",
                "job_id": job,
                "image_id": "m",
                "image_url": f"s3://{bucket}/no-such-key.jpg",
            },
        )
        await publish_raw(
            js,
            settings,
            {"id": "t-invalid", "job_id": job, "image_id": "i", "image_url": "ftp://nowhere/x.jpg"},
        )
        await publish_raw(js, settings, b"this is not json {")
        results = await wait_results(js, settings, job, 9)
        await consumer_idle(js, settings)
        dead = await js.get_last_msg(
            settings.nats.dead_letter_stream, settings.nats.dead_letter_subject
        )

    by_id = {r["task_id"]: r for r in results}
    assert len(results) == 9
    assert [by_id[task.id]["status"] for task in submitted] == ["ok"] * 5
    assert by_id["t-corrupt"]["error"]["type"] == "corrupt_image"
    assert by_id["t-truncated"]["error"]["type"] == "corrupt_image"
    assert by_id["t-missing"]["error"]["type"] == "object_missing"
    assert by_id["t-invalid"]["error"]["type"] == "invalid_task"
    assert all(
        by_id[t]["error"]["retryable"] is False for t in ("t-corrupt", "t-missing", "t-invalid")
    )
    assert dead.data == b"this is not json {"
    assert "not JSON" in dead.headers["Worker-Reason"]


async def test_a_task_published_again_after_its_result_was_stored_is_not_run_again(
    nats_server, s3_server, bucket, settings_for
):
    settings = settings_for(nats_server.url)
    uris = upload_images(s3_server.client(), bucket, 3)
    job = "job-redelivered"
    async with running_worker(settings) as app, client(settings) as js:
        tasks = await submit(js, settings, job, uris)
        first = await wait_results(js, settings, job, 3)
        # The same task again, past any deduplication window: a new message, same task id.
        await publish_raw(js, settings, tasks[0].as_dict())
        await consumer_idle(js, settings)
        results = await job_results(js, settings.nats, job)
        assert app.worker is not None
        metrics = app.worker.services.metrics.registry
        doubled = metrics.get_sample_value("inference_worker_results_already_stored_total")
        served = {"outcome": "ok", "pipeline": settings.model.pipeline}
        settled = metrics.get_sample_value("inference_worker_tasks_total", served)

    # Every delivery is looked up before it runs (a job's consumer made again delivers its
    # tasks anew, as first deliveries): the copy is acked with no second run, no second store.
    assert settled == 3, "the copy ran again although its result was stored"
    assert not doubled, "a second result was attempted"
    assert sorted(results, key=lambda r: r["task_id"]) == sorted(first, key=lambda r: r["task_id"])


async def test_a_redelivery_whose_result_is_already_stored_is_acked_without_new_work(
    nats_server, s3_server, bucket, settings_for
):
    """The worker stored a result, then died before its ack: the redelivery only acks."""
    from worker.nats.connection import connect
    from worker.nats.feed import TaskFeed
    from worker.nats.parts import result_store
    from worker.nats.provision import provision

    settings = settings_for(nats_server.url)
    uris = upload_images(s3_server.client(), bucket, 1)
    job = "job-ack-lost"
    nc = await connect(settings.nats, give_up_after_s=30)
    js = nc.jetstream()
    await provision(js, settings.nats, settings.model.pipeline)
    tasks = await submit(js, settings, job, uris)
    feed = TaskFeed(nc, settings.nats, [settings.model.pipeline])
    await feed.open()
    [msg] = await feed.fetch(1)
    stored = {"task_id": tasks[0].id, "job_id": job, "status": "ok", "marker": "first-worker"}
    assert await result_store(js, settings.nats).store(stored) is True
    await msg.nak()  # the first worker is gone; the task comes back
    await feed.close()

    async with running_worker(settings):
        await consumer_idle(js, settings)
    results = await job_results(js, settings.nats, job)
    await nc.close()

    assert results == [stored]


async def test_transient_failures_are_retried_then_end_with_deliveries_ran_out(
    nats_server, settings_for
):
    """S3 unreachable: naked with backoff, and on the last delivery an error result says why."""
    settings = settings_for(
        nats_server.url,
        nats={"max_deliver": 2},
        s3={"endpoint_url": "http://127.0.0.1:9", "connect_timeout_s": 0.5, "max_attempts": 1},
    )
    async with running_worker(settings), client(settings) as js:
        await submit(js, settings, "job-unreachable", ["s3://any/one.jpg"])
        [result] = await wait_results(js, settings, "job-unreachable", 1)
        info = await consumer_idle(js, settings)

    assert result["status"] == "error"
    assert result["attempt"] == 2
    assert result["error"]["retryable"] is True
    assert "deliveries ran out after 2 attempts" in result["error"]["message"]
    assert info.num_redelivered == 0  # nothing still waiting for another try


async def test_the_loader_children_serve_job_after_job(
    nats_server, s3_server, bucket, settings_for
):
    settings = settings_for(nats_server.url)
    uris = upload_images(s3_server.client(), bucket, 4)
    async with running_worker(settings) as app, client(settings) as js:
        assert app.engine is not None
        before = app.engine.loader.child_pids()
        for n in range(3):
            await submit(js, settings, f"job-pids-{n}", uris)
            await wait_results(js, settings, f"job-pids-{n}", len(uris))
        after = app.engine.loader.child_pids()

    assert len(before) == settings.loader.num_workers
    assert after == before


class GatedPredictor:
    """Wraps the real model: records batch sizes; the first batch waits for ``release``."""

    def __init__(self, inner):
        self.inner = inner
        self.sizes = []
        self.entered = threading.Event()
        self.release = threading.Event()

    @property
    def copy_ahead_images(self):
        return self.inner.copy_ahead_images

    def copy_ahead(self, images):
        return self.inner.copy_ahead(images)

    def run(self, images, while_running):
        self.sizes.append(len(images))
        self.entered.set()
        if not self.release.wait(30):
            raise TimeoutError("the test never released the first batch")
        return self.inner.run(images, while_running)


async def _until(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_tasks_arriving_one_by_one_while_the_model_is_busy_run_as_full_batches(
    nats_server, s3_server, bucket, settings_for
):
    settings = settings_for(nats_server.url, loader={"batch_size": 4, "prefetch_batches": 4})
    uris = upload_images(s3_server.client(), bucket, 9)
    async with running_worker(settings) as app, client(settings) as js:
        assert app.engine is not None and app.worker is not None
        from worker.engine.predictors import OneModel

        gate = GatedPredictor(app.engine.models.acquire(""))
        app.engine.models = OneModel(gate)
        tasks = make_tasks("job-trickle", uris)
        await publish_tasks(js, settings.nats, settings.model.pipeline, tasks[:1])
        await asyncio.get_running_loop().run_in_executor(None, gate.entered.wait, 10)
        for n in range(1, len(tasks)):  # each one fetched on its own before the next is sent
            await publish_tasks(js, settings.nats, settings.model.pipeline, tasks[n : n + 1])
            await _until(lambda n=n: len(app.worker.claims) == n + 1)
        gate.release.set()
        results = await wait_results(js, settings, "job-trickle", len(tasks))

    assert {r["status"] for r in results} == {"ok"}
    assert gate.sizes == [1, 4, 4]


async def test_weights_load_from_s3_and_their_sha256_is_in_every_result(
    nats_server, s3_server, bucket, settings_for, model_path
):
    import hashlib
    from pathlib import Path

    s3 = s3_server.client()
    s3.upload_file(model_path, bucket, "models/model.pt")
    s3.upload_file(str(Path(model_path).parent / "labels.txt"), bucket, "models/labels.txt")
    settings = settings_for(nats_server.url, model={"weights": f"s3://{bucket}/models/model.pt"})
    uris = upload_images(s3, bucket, 2)
    async with running_worker(settings), client(settings) as js:
        await submit(js, settings, "job-s3-weights", uris)
        results = await wait_results(js, settings, "job-s3-weights", 2)

    expected = hashlib.sha256(Path(model_path).read_bytes()).hexdigest()
    assert {r["model"]["weights_sha256"] for r in results} == {expected}
    labels = set(Path(model_path).parent.joinpath("labels.txt").read_text().split())
    assert {
        c["classification"]
        for r in results
        for d in r["response"]["detections"]
        for c in d["classifications"]
    } <= labels
