"""Throughput against the pipeline's limit, today's patterns, and per-job overhead, in one run.

    .venv/bin/python -m bench.throughput [--images 48] [--tasks 192] [--runs 3]

Writes bench/results/throughput.json and bench/results/throughput.png.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import torch

from bench.common import (
    ARCHITECTURE,
    PIPELINE,
    CpuMeter,
    PeakRss,
    World,
    cycle,
    machine,
    median,
    run_benchmark,
    start_worker,
    stop_worker,
    upload,
    world,
)
from config.settings import NatsSettings, load_settings
from worker.commands.client import make_tasks, publish_tasks
from worker.nats.connection import connect
from worker.nats.provision import provision
from worker.nats.subjects import job_results_subject

BATCH = 16
WORKERS = 2
SIZES = [(1920, 1080), (4096, 2160)]
PATTERN_RUNS = 3


def nats_settings(w: World) -> NatsSettings:
    return load_settings(for_worker=False, nats={"url": w.nats.url}).nats


class LoaderAlone:
    """The worker's loader with nothing after it: submit a job's requests, take every image."""

    def __init__(self, w: World) -> None:
        from datasets.loader import LoaderConfig, StreamingLoader
        from datasets.sources import SourceConfig

        self.loader = StreamingLoader(
            LoaderConfig(WORKERS, 60.0, 224, SourceConfig(s3_endpoint_url=w.s3.endpoint_url))
        )
        self._keys = 0

    def __enter__(self) -> LoaderAlone:
        self.loader.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.loader.close()

    def seconds(self, uris: list[str]) -> float:
        from datasets.loader import LoadRequest

        started = time.perf_counter()
        self.loader.submit([LoadRequest(self._keys + i, uri) for i, uri in enumerate(uris)])
        self._keys += len(uris)
        for _ in uris:
            self.loader.next_loaded()
        return time.perf_counter() - started


class ModelAlone:
    """The worker's model on ready uint8 batches, with torch's default threads."""

    def __init__(self, w: World) -> None:
        from datasets.sources import SourceConfig
        from pipelines.declare import Classifier
        from pipelines.models import ClassifierModel

        stage = Classifier("c", architecture=ARCHITECTURE, weights=w.weights)
        self.model = ClassifierModel(stage, SourceConfig(), torch.device("cpu"))
        self.batch = torch.randint(0, 256, (BATCH, 3, 224, 224), dtype=torch.uint8)
        self.model.logits(self.batch)

    def seconds(self, images: int) -> float:
        started = time.perf_counter()
        for _ in range(images // BATCH):
            self.model.logits(self.batch)
        return (time.perf_counter() - started) * images / (images // BATCH * BATCH)


@asynccontextmanager
async def workers(
    w: World, processes: int = 1, loader_workers: int = WORKERS
) -> AsyncIterator[tuple[Any, NatsSettings, list[subprocess.Popen[bytes]]]]:
    """``processes`` `inference-worker run` processes on one consumer, and a JetStream client."""
    settings = nats_settings(w)
    nc = await connect(settings)
    js = nc.jetstream()
    await provision(js, settings, PIPELINE)
    procs = [
        start_worker(
            w,
            f"throughput-worker-{n}.log",
            WORKER_LOADER__BATCH_SIZE=str(BATCH),
            WORKER_LOADER__NUM_WORKERS=str(loader_workers),
        )
        for n in range(processes)
    ]
    try:
        yield js, settings, procs
    finally:
        for proc in procs:
            stop_worker(proc)
        await nc.close()


async def end_to_end(
    w: World, uris: list[str], runs: int, processes: int = 1, loader_workers: int = WORKERS
) -> dict[str, float]:
    """Images/s from publish to stored results through ``processes`` workers on one consumer."""
    rates = []
    async with workers(w, processes, loader_workers) as (js, settings, _procs):
        for run in range(runs + 1):  # the first job warms up
            seconds = await run_job(js, settings, f"scale-{processes}-{run}", uris)
            if run:
                rates.append(len(uris) / seconds)
    return {"images_per_s": median(rates)}


async def stages_and_worker(w: World, uris: list[str], runs: int) -> dict[str, Any]:
    """The loader alone, the model alone and the worker end to end, interleaved round by
    round, so that a machine whose speed drifts (shared cores) skews all three alike; the
    ratio is taken per round, then the median."""
    n = len(uris)
    loader_cpu, worker_cpu = CpuMeter(), CpuMeter()
    rounds: list[dict[str, float]] = []
    with LoaderAlone(w) as loader:
        model = ModelAlone(w)
        async with workers(w) as (js, settings, procs):
            with PeakRss(procs[0].pid) as peak:
                for run in range(runs + 1):  # the first round warms up
                    with loader_cpu if run else CpuMeter():
                        loader_s = loader.seconds(uris)
                    model_s = model.seconds(n)
                    with worker_cpu if run else CpuMeter():
                        worker_s = await run_job(js, settings, f"tp-{run}", uris)
                    if run:
                        rounds.append(
                            {
                                "loader_images_per_s": n / loader_s,
                                "model_images_per_s": n / model_s,
                                "end_to_end_images_per_s": n / worker_s,
                                "ratio": max(loader_s, model_s) / worker_s,
                            }
                        )
                overhead = await per_job_overhead(js, settings, uris[0])
    return {
        "rounds": rounds,
        "loader_alone": {
            "images_per_s": median([r["loader_images_per_s"] for r in rounds]),
            **loader_cpu.summary(n * runs),
        },
        "model_alone_images_per_s": median([r["model_images_per_s"] for r in rounds]),
        "end_to_end": {
            "images_per_s": median([r["end_to_end_images_per_s"] for r in rounds]),
            "peak_rss_bytes": peak.peak_bytes,
            **worker_cpu.summary(n * runs),
            **overhead,
        },
        "ratio_end_to_end_to_slower_stage": median([r["ratio"] for r in rounds]),
    }


async def run_job(js: Any, settings: NatsSettings, job: str, uris: list[str]) -> float:
    """Seconds from the first publish to the arrival of the job's last result."""
    done: asyncio.Future[float] = asyncio.get_running_loop().create_future()
    seen: set[str] = set()

    async def on_result(msg: Any) -> None:
        seen.add(msg.subject)  # one subject per task
        if len(seen) == len(uris) and not done.done():
            done.set_result(time.perf_counter())

    sub = await js._nc.subscribe(job_results_subject(job), cb=on_result)
    try:
        started = time.perf_counter()
        await publish_tasks(js, settings, PIPELINE, make_tasks(job, uris))
        return await asyncio.wait_for(done, 600) - started
    finally:
        await sub.unsubscribe()


async def per_job_overhead(
    js: Any, settings: NatsSettings, uri: str, jobs: int = 30
) -> dict[str, float]:
    """One-image jobs: publish -> stored result, minus the time spent decoding and inferring."""
    nc = js._nc
    overheads, latencies = [], []
    for n in range(jobs):
        job = f"one-{n}-{time.time_ns()}"
        got: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        async def on_result(msg: Any, fut: asyncio.Future[Any] = got) -> None:
            if not fut.done():
                fut.set_result((time.perf_counter(), json.loads(msg.data)))

        sub = await nc.subscribe(job_results_subject(job), cb=on_result)
        started = time.perf_counter()
        await publish_tasks(js, settings, PIPELINE, make_tasks(job, [uri]))
        stored_at, result = await asyncio.wait_for(got, 30)
        await sub.unsubscribe()
        latency = stored_at - started
        work = result["timings_s"].get("load_s", 0) + result["timings_s"].get("infer_s", 0)
        latencies.append(latency)
        overheads.append(latency - work)
        await asyncio.sleep(0.05)
    return {"one_image_latency_s": median(latencies), "per_job_overhead_s": median(overheads)}


def pattern(w: World, name: str, uris_file: str) -> dict[str, float]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.patterns", name, uris_file, w.s3.endpoint_url, w.weights],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    with PeakRss(proc.pid) as peak:
        out, _ = proc.communicate(timeout=1800)
    result = json.loads(out.decode().strip().splitlines()[-1])
    return {"images_per_s": result["images_per_s"], "peak_rss_bytes": peak.peak_bytes}


def chart(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [
        "loader alone",
        "model alone",
        "worker (e2e)",
        "(a) fork rebuilt\nfull-res f32",
        "(b) num_workers=0",
        "(c) forkserver rebuilt\nno preload",
    ]
    values = [
        result["loader_alone"]["images_per_s"],
        result["model_alone_images_per_s"],
        result["end_to_end"]["images_per_s"],
        result["patterns"]["fork_rebuilt"]["images_per_s"],
        result["patterns"]["no_workers"]["images_per_s"],
        result["patterns"]["forkserver_rebuilt"]["images_per_s"],
    ]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    bars = ax.bar(names, values, color=["#999", "#999", "#2a7", "#c55", "#c55", "#c55"])
    ax.bar_label(bars, fmt="%.1f")
    ax.set_ylabel("images/s (median)")
    ax.set_title(
        f"{result['tasks_per_job']}-task jobs over {result['images']} JPEGs, "
        "1920x1080 and 4096x2160; "
        f"{result['machine']['cores']} cores, CPU\nworker / slower stage = "
        f"{result['ratio_end_to_end_to_slower_stage']:.2f} (median of rounds)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def stages(w: World, uris: list[str], images: int, tasks: int, runs: int) -> dict[str, Any]:
    """The run's settings and the three stages' figures (``bench.stages`` stops here)."""
    result: dict[str, Any] = {
        "machine": machine(),
        "images": images,
        "tasks_per_job": tasks,
        "runs": runs,
        "batch_size": BATCH,
        "loader_workers": WORKERS,
    }
    result.update(await stages_and_worker(w, uris, runs))
    return result


async def run(images: int, tasks: int, runs: int) -> dict[str, Any]:
    with world() as w:
        distinct = upload(w.s3.client(), "throughput", SIZES, images)
        uris = cycle(distinct, tasks)
        uris_file = w.workdir / "uris.json"
        uris_file.write_text(json.dumps(distinct))
        result = await stages(w, uris, images, tasks, runs)
        result["patterns"] = {}
        for name in ("fork_rebuilt", "no_workers", "forkserver_rebuilt"):
            rates, peaks = [], []
            for _ in range(min(runs, PATTERN_RUNS)):  # minutes each; three are plenty
                one = pattern(w, name, str(uris_file))
                rates.append(one["images_per_s"])
                peaks.append(one["peak_rss_bytes"])
            result["patterns"][name] = {"images_per_s": median(rates), "peak_rss_bytes": max(peaks)}
    return result


def main() -> None:
    result, path = run_benchmark("throughput", run)
    chart(result, str(path.with_suffix(".png")))


if __name__ == "__main__":
    main()
