"""The throughput benchmark's stages (``bench.throughput``): the worker's loader alone (by its
default, fast and exact paths), its model alone, and the worker end to end, interleaved round
by round; and the per-job overhead of one-image jobs. Every stage counts its outcomes and
stops the run (``BenchmarkFailed``) if any image failed."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import torch

from bench.common.job_runs import Job, client, count, run_job, run_jobs
from bench.common.meters import CpuMeter, PeakRss, TreeCpu, machine, median, tree
from bench.common.world import (
    ARCHITECTURE,
    PIPELINE,
    World,
    nats_settings,
    start_worker,
    stop_worker,
)
from bench.outcomes import Outcomes
from config.settings import NatsSettings
from datasets.images import DecodePlan

if TYPE_CHECKING:
    from datasets.images import Decoded
    from datasets.loader import StreamingLoader

BATCH = 16
WORKERS = 2
SIZES = [(1920, 1080), (4096, 2160)]


# The loader paths measured side by side: the worker's default, and the two settings.
PATHS = {"default": {}, "fast": {"fast": True}, "exact": {"exact": True}}


def worker_plan(w: World, **path: bool) -> DecodePlan:
    """The decode plan the worker makes for the benchmark's pipeline (``fast`` or ``exact``
    as the settings of those names give them)."""
    from pipelines.registry import resolve
    from pipelines.runner import decode_plan

    pipeline = resolve(PIPELINE, w.weights)
    return decode_plan(pipeline, 4096, path.get("fast", False), exact=path.get("exact", False))


class LoaderAlone:
    """The worker's loader with nothing after it: submit a job's requests, take every image,
    and count what came back (an image of the plan's shape, or a failure)."""

    def __init__(self, w: World, plan: DecodePlan, name: str = "loader alone") -> None:
        from datasets.loader import LoaderConfig, StreamingLoader
        from datasets.uris import SourceConfig

        self.plan = plan
        self.name = name
        self.loader = StreamingLoader(
            LoaderConfig(WORKERS, 60.0, plan, SourceConfig(s3_endpoint_url=w.s3.endpoint_url))
        )
        self.cpu = TreeCpu(self.loader.child_pids)
        self._keys = 0

    def __enter__(self) -> LoaderAlone:
        self.loader.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.loader.close()

    def seconds(self, uris: list[str]) -> float:
        """Seconds to load every one of ``uris``; ``BenchmarkFailed`` unless all were images."""
        outcomes = Outcomes(self.name)
        shape = (3, self.plan.size, self.plan.size)
        started = time.perf_counter()
        with self.cpu:
            take_loaded(self.loader, self._keys, uris, shape, outcomes)
            self._keys += len(uris)
        elapsed = time.perf_counter() - started
        outcomes.check(len(uris))
        return elapsed


class ModelAlone:
    """The worker's model on ready uint8 batches, with torch's default threads."""

    def __init__(self, w: World) -> None:
        from datasets.uris import SourceConfig
        from pipelines.declare import Classifier
        from pipelines.models import ClassifierModel

        stage = Classifier("c", architecture=ARCHITECTURE, weights=w.weights)
        self.model = ClassifierModel(stage, SourceConfig(), torch.device("cpu"))
        self.batch = torch.randint(0, 256, (BATCH, 3, 224, 224), dtype=torch.uint8)
        self.model.logits(self.batch)

    def seconds(self, images: int) -> float:
        """Seconds for ``images`` forward passes; ``BenchmarkFailed`` for logits that are not
        one finite row of 10 per image."""
        outcomes = Outcomes("model alone")
        batches = max(1, images // BATCH)
        started = time.perf_counter()
        for _ in range(batches):
            logits = self.model.logits(self.batch)
            if tuple(logits.shape) == (BATCH, 10) and bool(torch.isfinite(logits).all()):
                outcomes.good(BATCH)
            else:
                outcomes.bad("bad_logits", f"logits {tuple(logits.shape)}, finite or not")
        elapsed = time.perf_counter() - started
        outcomes.check(batches * BATCH)
        return elapsed * images / (batches * BATCH)


@asynccontextmanager
async def a_worker(w: World) -> AsyncIterator[tuple[Any, NatsSettings, subprocess.Popen[bytes]]]:
    """An `inference-worker run` process, and a NATS client of its server."""
    settings = nats_settings(w)
    async with client(settings, PIPELINE) as nc:
        proc = start_worker(
            w,
            "throughput-worker.log",
            WORKER_LOADER__BATCH_SIZE=str(BATCH),
            WORKER_LOADER__NUM_WORKERS=str(WORKERS),
        )
        try:
            yield nc, settings, proc
        finally:
            stop_worker(proc)


async def stages_and_worker(
    w: World, uris: list[str], runs: int, overhead_jobs: int = 30
) -> dict[str, Any]:
    """The loader alone (by each path of ``PATHS``), the model alone and the worker end to
    end, interleaved round by round, so that a machine whose speed drifts (shared cores) skews
    them alike; the ratio is taken per round, then the median. Every stage counts its outcomes
    and stops the run (``BenchmarkFailed``) if any image failed."""
    machine_cpu = {name: CpuMeter() for name in [*PATHS, "worker"]}
    with contextlib.ExitStack() as stack:
        loaders = {
            name: stack.enter_context(
                LoaderAlone(w, worker_plan(w, **path), f"loader alone ({name} path)")
            )
            for name, path in PATHS.items()
        }
        model = ModelAlone(w)
        async with a_worker(w) as (nc, settings, proc):
            worker_cpu = TreeCpu(tree(proc.pid))
            with PeakRss(proc.pid) as peak:
                rounds = []
                for run in range(runs + 1):  # the first round warms up
                    if run == 1:
                        for meter in [*(loader.cpu for loader in loaders.values()), worker_cpu]:
                            meter.cpu_s = 0.0
                    seconds = {}
                    for name, loader in loaders.items():
                        with machine_cpu[name] if run else CpuMeter():
                            seconds[name] = loader.seconds(uris)
                    model_s = model.seconds(len(uris))
                    with machine_cpu["worker"] if run else CpuMeter(), worker_cpu:
                        worker_s = await run_job(nc, settings, f"tp-{run}", uris)
                    if run:
                        rounds.append(one_round(len(uris), seconds, model_s, worker_s))
                overhead = await per_job_overhead(nc, settings, uris[0], overhead_jobs)
    worker = {"peak_rss_bytes": peak.peak_bytes, **overhead}
    return figures(rounds, loaders, worker_cpu, machine_cpu, worker, len(uris) * runs)


def figures(
    rounds: list[dict[str, float]],
    loaders: dict[str, LoaderAlone],
    worker_cpu: TreeCpu,
    machine_cpu: dict[str, CpuMeter],
    worker: dict[str, Any],
    images: int,
) -> dict[str, Any]:
    """The stages' medians over the rounds, and the CPU each spent per image."""
    return {
        "rounds": rounds,
        "loader_alone": {
            name: {
                "images_per_s": median([r[f"loader_{name}_images_per_s"] for r in rounds]),
                "children_cpu_ms_per_image": loader.cpu.ms_per_image(images),
                **machine_cpu[name].summary(images),
            }
            for name, loader in loaders.items()
        },
        "model_alone_images_per_s": median([r["model_images_per_s"] for r in rounds]),
        "end_to_end": {
            "images_per_s": median([r["end_to_end_images_per_s"] for r in rounds]),
            "tree_cpu_ms_per_image": worker_cpu.ms_per_image(images),
            **machine_cpu["worker"].summary(images),
            **worker,
        },
        "ratio_end_to_end_to_slower_stage": median([r["ratio"] for r in rounds]),
        "default_to_fast_loader_cpu": round(
            loaders["default"].cpu.cpu_s / max(1e-9, loaders["fast"].cpu.cpu_s), 3
        ),
    }


def one_round(
    n: int, loader_s: dict[str, float], model_s: float, worker_s: float
) -> dict[str, float]:
    """One round's rates; the ratio is against the slower of the worker's own loader path
    (the default) and the model."""
    row = {f"loader_{name}_images_per_s": n / seconds for name, seconds in loader_s.items()}
    row["model_images_per_s"] = n / model_s
    row["end_to_end_images_per_s"] = n / worker_s
    row["ratio"] = max(loader_s["default"], model_s) / worker_s
    return row


async def per_job_overhead(
    nc: Any, settings: NatsSettings, uri: str, jobs: int = 30
) -> dict[str, float]:
    """One-image jobs, one after the other (``run_jobs``): publish -> the result's arrival,
    minus the time spent decoding and inferring."""
    overheads, latencies = [], []
    for n in range(jobs):
        job = Job(f"one-{n}-{time.time_ns()}", [uri])
        (done,) = await run_jobs(nc, settings, [job], timeout_s=30)
        (result,) = done.received()
        outcomes = Outcomes(f"one-image job {n}")
        count(outcomes, result)
        outcomes.check(1)
        latency = done.done_at - done.published_at
        work = result["timings_s"].get("load_s", 0) + result["timings_s"].get("infer_s", 0)
        latencies.append(latency)
        overheads.append(latency - work)
        await asyncio.sleep(0.05)
    return {"one_image_latency_s": median(latencies), "per_job_overhead_s": median(overheads)}


async def stages(
    w: World, uris: list[str], images: int, tasks: int, runs: int, smoke: bool = False
) -> dict[str, Any]:
    """The run's settings and the stages' figures."""
    result: dict[str, Any] = {
        "machine": machine(),
        "images": images,
        "tasks_per_job": tasks,
        "runs": runs,
        "batch_size": BATCH,
        "loader_workers": WORKERS,
    }
    result.update(await stages_and_worker(w, uris, runs, 3 if smoke else 30))
    return result


def take_loaded(
    loader: StreamingLoader,
    first_key: int,
    uris: list[str],
    shape: tuple[int, ...],
    outcomes: Outcomes,
) -> list[Decoded]:
    """Submit one request per URI to a started loader (keys ``first_key`` on) and take every
    outcome: a failure, or an image not of ``shape``, is counted bad in ``outcomes``; the good
    images are returned in the order they came."""
    from datasets.loader import LoadRequest

    loader.submit([LoadRequest(first_key + i, uri) for i, uri in enumerate(uris)])
    images = []
    for _ in uris:
        loaded = loader.next_loaded()
        if loaded.failure is not None:
            outcomes.bad(loaded.failure.kind, loaded.failure.message)
        elif loaded.image is None or tuple(loaded.image.pixels.shape) != shape:
            got = None if loaded.image is None else tuple(loaded.image.pixels.shape)
            outcomes.bad("wrong_shape", f"image {got}, {shape} expected")
        else:
            outcomes.good()
            images.append(loaded.image)
    return images
