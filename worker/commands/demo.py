"""``inference-worker demo``: the main job on an embedded default, start to finish, then clean up.

Starts a local nats-server and a local S3 endpoint on 127.0.0.1, makes a small model and a few
dozen images (one of them corrupt), submits a job, runs the worker until every task has a
result, prints a per-task table and the summary, and stops everything it started.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from typing import Any

import structlog

from config.settings import Settings, load_settings
from worker.commands.client import job_results, make_tasks, publish_tasks, summarize
from worker.commands.demo_images import corrupt_bytes, image_bytes
from worker.commands.localservers import NatsServer, S3Server
from worker.exits import CommandExit

log = structlog.get_logger(__name__)

PIPELINE = "mobilenet-v3-small-classifier"
ARCHITECTURE = "mobilenet_v3_small"
LABELS = ["cat", "dog", "bird", "fish", "horse", "sheep", "cow", "bear", "zebra", "giraffe"]
SIZES = [(640, 480), (1280, 720), (1920, 1080), (800, 800), (3840, 2160), (480, 640)]
IMAGES = 36
JOB_ID = "demo-job-1"
RESULT_WAIT_S = 300.0


def _upload_fixtures(s3: Any, workdir: str) -> list[str]:
    from pipelines.models import save_classifier

    s3.create_bucket(Bucket="demo-models")
    s3.create_bucket(Bucket="demo-images")
    weights = save_classifier(ARCHITECTURE, LABELS, os.path.join(workdir, "model"))
    s3.upload_file(weights, "demo-models", "mobilenet/model.pt")
    s3.upload_file(
        os.path.join(workdir, "model", "labels.txt"), "demo-models", "mobilenet/labels.txt"
    )
    uris = []
    for i in range(IMAGES):
        if i == IMAGES // 2:
            key, body = f"images/{i:03d}-corrupt.jpg", corrupt_bytes(i)
        else:
            width, height = SIZES[i % len(SIZES)]
            fmt = "PNG" if i % 7 == 3 and width < 2000 else "JPEG"
            key = f"images/{i:03d}-{width}x{height}.{'png' if fmt == 'PNG' else 'jpg'}"
            body = image_bytes(width, height, seed=i, fmt=fmt)
        s3.put_object(Bucket="demo-images", Key=key, Body=body)
        uris.append(f"s3://demo-images/{key}")
    return uris


def _print_report(results: list[dict[str, Any]], expected: set[str]) -> int:
    by_task = {r["task_id"]: r for r in results}
    print(f"\n{'task':<22} {'image':<28} {'status':<7} {'attempt':<8} detail")
    print("-" * 100)
    for task_id in sorted(expected):
        r = by_task.get(task_id)
        if r is None:
            print(f"{task_id:<22} {'?':<28} {'MISSING':<7}")
            continue
        if r["status"] == "ok":
            best = r["response"]["detections"][0]["classifications"][0]
            detail = f"{best['classification']} {max(best['scores']):.3f}"
        else:
            detail = f"{r['error']['type']}: {r['error']['message'][:60]}"
        print(f"{task_id:<22} {r['image_id']:<28} {r['status']:<7} {r['attempt']:<8} {detail}")
    summary = summarize(results, expected)
    print("-" * 100)
    print(f"summary: {summary.line()} duplicates={summary.duplicates} total={len(expected)}")
    whole = summary.missing == 0 and summary.duplicates == 0
    return CommandExit.OK if whole else CommandExit.FAILED


def _demo_settings(nats_url: str, s3_endpoint_url: str) -> Settings:
    """A worker for the demo's servers: small batches, quick retries, metrics on any port."""
    return load_settings(
        nats={"url": nats_url, "max_deliver": 3, "nak_backoff_base_s": 0.5},
        s3={"endpoint_url": s3_endpoint_url, "read_timeout_s": 10, "max_attempts": 2},
        loader={"num_workers": 2, "batch_size": 8, "timeout_s": 45},
        model={
            "pipeline": PIPELINE,
            "weights": "s3://demo-models/mobilenet/model.pt",
            "device": "auto",
        },
        health={"stall_timeout_s": 60},
        metrics={"port": 0},
    )


async def run_demo() -> int:
    from worker.app import WorkerApp
    from worker.nats.connection import connect

    workdir = tempfile.mkdtemp(prefix="iw-demo-")
    nats_server = NatsServer(store_dir=os.path.join(workdir, "nats"))
    s3_server = S3Server()
    app: WorkerApp | None = None
    try:
        print("starting nats-server and the S3 endpoint on 127.0.0.1 ...")
        nats_server.start()
        s3_server.start()
        os.environ.update(s3_server.credentials_env())
        uris = _upload_fixtures(s3_server.client(), workdir)
        print(f"uploaded a {PIPELINE} model and {len(uris)} images (one corrupt)")
        settings = _demo_settings(nats_server.url, s3_server.endpoint_url)
        app = WorkerApp(settings, until_idle=True)  # burst mode: done when the job is
        started = time.monotonic()
        await app.start()
        print(
            f"worker up in {time.monotonic() - started:.1f}s; "
            f"loader pids {app.engine.loader.child_pids() if app.engine else []}"
        )
        client = await connect(settings.nats, name="demo-client", give_up_after_s=30)
        js = client.jetstream()
        tasks = make_tasks(JOB_ID, uris)
        await publish_tasks(js, settings.nats, PIPELINE, tasks)
        print(f"submitted job {JOB_ID}: {len(tasks)} tasks")
        stop = asyncio.Event()
        running = asyncio.create_task(app.run(stop))
        done, _ = await asyncio.wait({running}, timeout=RESULT_WAIT_S)
        if not done:
            stop.set()  # bounded: a job that cannot finish still ends the demo
        await running
        print(f"job finished in {time.monotonic() - started:.1f}s")
        expected = {t.id for t in tasks}
        results = await job_results(js, settings.nats, JOB_ID)
        await client.close()
        return _print_report(results, expected)
    finally:
        if app is not None:
            await app.close()
        s3_server.stop()
        nats_server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        print("stopped the worker, nats-server and the S3 endpoint; removed", workdir)
