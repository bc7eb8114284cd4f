"""``inference-worker demo``: two jobs on two pipelines in one worker process, start to
finish, then clean up.

Starts a local nats-server and a local S3 endpoint on 127.0.0.1, makes images of coloured
rectangles (one of them corrupt), submits a job to a colour classifier and a job to a
detect-and-classify pipeline (a test detector that boxes bright rectangles, then the colour
classifier on each box; ``demo_models``), runs one worker serving both until every task has a
result, prints per image its boxes and labels against what was drawn, and the summary, and
stops everything it started.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import tempfile
import time
from typing import Any

import structlog

from config.settings import Settings, load_settings
from worker.commands.demo_images import corrupt_bytes, rectangles_bytes
from worker.commands.job_client import job_results, make_tasks, publish_tasks, summarize
from worker.commands.localservers import NatsServer, S3Server
from worker.core.exits import CommandExit

log = structlog.get_logger(__name__)

MODELS = "worker.commands.demo_models"
PIPELINES = {
    "colours": f"{MODELS}:colour_classifier",
    "boxes-and-colours": f"{MODELS}:boxes_and_colours",
}
JOBS = {"demo-colours": "colours", "demo-boxes": "boxes-and-colours"}
SIZES = [(640, 480), (1280, 720), (1920, 1080), (800, 800), (3840, 2160), (480, 640)]
IMAGES_PER_JOB = 18
RESULT_WAIT_S = 300.0
Drawn = list[tuple[int, int, int, int, str]]


def _scene(rng: random.Random, width: int, height: int, count: int) -> Drawn:
    """``count`` rectangles of random colours, each in columns of its own (the test detector
    boxes what does not share a column), the first the largest."""
    step = width // count
    drawn: Drawn = []
    for i in range(count):
        side = 0.8 if i == 0 else 0.4
        w, h = int(step * side), int(height * side)
        x1, y1 = i * step + (step - w) // 2, rng.randrange(0, height - h + 1)
        drawn.append((x1, y1, x1 + w, y1 + h, rng.choice(["red", "green", "blue"])))
    return drawn


def _upload_fixtures(s3: Any) -> dict[str, dict[str, Drawn]]:
    """Per job, its images' URIs and what each shows (empty: the corrupt one)."""
    s3.create_bucket(Bucket="demo-images")
    rng = random.Random(7)
    jobs: dict[str, dict[str, Drawn]] = {}
    for job in JOBS:
        jobs[job] = {}
        for i in range(IMAGES_PER_JOB):
            width, height = SIZES[i % len(SIZES)]
            if job == "demo-colours" and i == IMAGES_PER_JOB // 2:
                key, body, drawn = f"{job}/{i:03d}-corrupt.jpg", corrupt_bytes(i), []
            else:
                count = 1 if job == "demo-colours" else 1 + i % 3
                drawn = _scene(rng, width, height, count)
                key = f"{job}/{i:03d}-{width}x{height}.jpg"
                body = rectangles_bytes(width, height, drawn)
            s3.put_object(Bucket="demo-images", Key=key, Body=body)
            jobs[job][f"s3://demo-images/{key}"] = drawn
    return jobs


def _iou(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - w * h
    return w * h / union if union else 0.0


def _read(result: dict[str, Any], drawn: Drawn) -> tuple[str, bool]:
    """What the pipeline said of one image, and whether it is what was drawn."""
    found = []
    for detection in result["response"]["detections"]:
        best = detection["classifications"][-1]
        box = detection["bbox"]
        found.append((box, best["classification"], max(best["scores"])))
    if len(found) == 1 and found[0][0] is None:  # the classifier alone: the whole image
        _, label, score = found[0]
        return f"{label} {score:.3f}", label == drawn[0][4]
    said = "; ".join(
        f"[{b['x1']:.0f},{b['y1']:.0f},{b['x2']:.0f},{b['y2']:.0f}] {label} {score:.2f}"
        for b, label, score in found
    )
    matched = len(found) == len(drawn) and all(
        any(
            _iou((b["x1"], b["y1"], b["x2"], b["y2"]), d[:4]) > 0.9 and label == d[4] for d in drawn
        )
        for b, label, _score in found
    )
    return f"{len(found)} boxes: {said}", matched


def _print_report(
    results: dict[str, list[dict[str, Any]]],
    tasks: dict[str, dict[str, str]],
    drawn: dict[str, dict[str, Drawn]],
) -> int:
    """Per image: its job, pipeline, status and what the model said; then the summary."""
    print(f"\n{'job / pipeline':<32} {'image':<24} {'status':<7} {'as drawn':<9} boxes and labels")
    print("-" * 120)
    as_drawn = checked = 0
    everything: list[dict[str, Any]] = []
    for job, by_task in tasks.items():
        by_id = {r["task_id"]: r for r in results[job]}
        everything += results[job]
        for task_id, uri in by_task.items():
            name = uri.rsplit("/", 1)[-1]
            r = by_id.get(task_id)
            head = f"{job + ' / ' + JOBS[job]:<32} {name:<24}"
            if r is None:
                print(f"{head} MISSING")
                continue
            if r["status"] != "ok":
                error = f"{r['error']['type']}: {r['error']['message'][:50]}"
                print(f"{head} {r['status']:<7} {'':<9} {error}")
                continue
            said, matched = _read(r, drawn[job][uri])
            checked += 1
            as_drawn += matched
            print(f"{head} {r['status']:<7} {'yes' if matched else 'NO':<9} {said[:100]}")
    expected = {task_id for by_task in tasks.values() for task_id in by_task}
    summary = summarize(everything, expected)
    print("-" * 120)
    print(f"as drawn: {as_drawn} of {checked} images answered")
    print(f"summary: {summary.line()} duplicates={summary.duplicates} total={len(expected)}")
    whole = summary.missing == 0 and summary.duplicates == 0
    return CommandExit.OK if whole else CommandExit.FAILED


def _demo_settings(nats_url: str, s3_endpoint_url: str) -> Settings:
    """A worker for the demo's servers serving both pipelines: small batches, quick retries,
    metrics on any port."""
    return load_settings(
        nats={"url": nats_url, "max_deliver": 3, "nak_backoff_base_s": 0.5},
        s3={"endpoint_url": s3_endpoint_url, "read_timeout_s": 10, "max_attempts": 2},
        loader={"num_workers": 2, "batch_size": 8, "timeout_s": 45},
        model={"pipelines": list(PIPELINES.values()), "device": "auto"},
        health={"stall_timeout_s": 60},
        metrics={"port": 0},
    )


async def _run_jobs(app: Any, settings: Settings, drawn: dict[str, Any], started: float) -> int:
    """Submit both jobs, run the worker until they are done (bounded), print the report."""
    from worker.nats.connection import connect

    client = await connect(settings.nats, name="demo-client", give_up_after_s=30)
    js = client.jetstream()
    tasks: dict[str, dict[str, str]] = {}
    for job, pipeline in JOBS.items():
        made = make_tasks(job, list(drawn[job]))
        await publish_tasks(js, settings.nats, pipeline, made)
        tasks[job] = {t.id: t.image_url for t in made}
        print(f"submitted job {job}: {len(made)} tasks on tasks.{pipeline}.{job}")
    stop = asyncio.Event()
    running = asyncio.create_task(app.run(stop))
    done, _ = await asyncio.wait({running}, timeout=RESULT_WAIT_S)
    if not done:
        stop.set()  # bounded: a job that cannot finish still ends the demo
    await running
    print(f"jobs finished in {time.monotonic() - started:.1f}s")
    results = {job: await job_results(js, settings.nats, job) for job in JOBS}
    await client.close()
    return _print_report(results, tasks, drawn)


async def run_demo() -> int:
    from worker.process.app import Assembly

    workdir = tempfile.mkdtemp(prefix="iw-demo-")
    nats_server = NatsServer(store_dir=os.path.join(workdir, "nats"))
    s3_server = S3Server()
    app: Assembly | None = None
    try:
        print("starting nats-server and the S3 endpoint on 127.0.0.1 ...")
        nats_server.start()
        s3_server.start()
        os.environ.update(s3_server.credentials_env())
        drawn = _upload_fixtures(s3_server.client())
        print(
            f"uploaded {sum(map(len, drawn.values()))} images of coloured rectangles (one corrupt)"
        )
        settings = _demo_settings(nats_server.url, s3_server.endpoint_url)
        app = Assembly(settings, until_idle=True)  # burst mode: done when the jobs are
        started = time.monotonic()
        await app.start()
        print(
            f"worker up in {time.monotonic() - started:.1f}s serving {', '.join(PIPELINES)}; "
            f"loader pids {app.engine.loader.child_pids() if app.engine else []}"
        )
        return await _run_jobs(app, settings, drawn, started)
    finally:
        if app is not None:
            await app.close()
        s3_server.stop()
        nats_server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        print("stopped the worker, nats-server and the S3 endpoint; removed", workdir)
