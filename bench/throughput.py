"""Throughput against the pipeline's limit, today's patterns, and per-job overhead, in one run.

    .venv/bin/python -m bench.throughput [--images 48] [--tasks 192] [--runs 3]

Writes bench/results/throughput.json and bench/results/throughput.png.
"""

from __future__ import annotations

import asyncio
import contextlib
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
    TreeCpu,
    World,
    cycle,
    last_json_line,
    machine,
    median,
    run_benchmark,
    start_worker,
    stop_worker,
    take_loaded,
    tree,
    upload,
    world,
)
from bench.outcomes import Outcomes, refusing
from config.settings import NatsSettings, load_settings
from datasets.images import DecodePlan
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
        from datasets.sources import SourceConfig

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
        from datasets.sources import SourceConfig
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


async def stages_and_worker(
    w: World, uris: list[str], runs: int, overhead_jobs: int = 30
) -> dict[str, Any]:
    """The loader alone (by each path of ``PATHS``), the model alone and the worker end to
    end, interleaved round by round, so that a machine whose speed drifts (shared cores) skews
    them alike; the ratio is taken per round, then the median. Every stage counts its outcomes
    and stops the run (``BenchmarkFailed``) if any image failed."""
    n = len(uris)
    machine_cpu = {name: CpuMeter() for name in [*PATHS, "worker"]}
    rounds: list[dict[str, float]] = []
    with contextlib.ExitStack() as stack:
        loaders = {
            name: stack.enter_context(
                LoaderAlone(w, worker_plan(w, **path), f"loader alone ({name} path)")
            )
            for name, path in PATHS.items()
        }
        model = ModelAlone(w)
        async with workers(w) as (js, settings, procs):
            worker_cpu = TreeCpu(tree(procs[0].pid))
            with PeakRss(procs[0].pid) as peak:
                for run in range(runs + 1):  # the first round warms up
                    if run == 1:
                        for loader in loaders.values():
                            loader.cpu.cpu_s = 0.0
                        worker_cpu.cpu_s = 0.0
                    seconds = {}
                    for name, loader in loaders.items():
                        with machine_cpu[name] if run else CpuMeter():
                            seconds[name] = loader.seconds(uris)
                    model_s = model.seconds(n)
                    with machine_cpu["worker"] if run else CpuMeter(), worker_cpu:
                        worker_s = await run_job(js, settings, f"tp-{run}", uris)
                    if run:
                        rounds.append(one_round(n, seconds, model_s, worker_s))
                overhead = await per_job_overhead(js, settings, uris[0], overhead_jobs)
    images = n * runs
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
            "peak_rss_bytes": peak.peak_bytes,
            "tree_cpu_ms_per_image": worker_cpu.ms_per_image(images),
            **machine_cpu["worker"].summary(images),
            **overhead,
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


async def run_job(
    js: Any, settings: NatsSettings, job: str, uris: list[str], pipeline: str = PIPELINE
) -> float:
    """Seconds from the first publish to the arrival of the job's last result;
    ``BenchmarkFailed`` unless every task's result is ``ok``."""
    done: asyncio.Future[float] = asyncio.get_running_loop().create_future()
    outcomes = Outcomes(f"worker end to end, job {job}")
    seen: set[str] = set()

    async def on_result(msg: Any) -> None:
        if msg.subject in seen:  # one subject per task; a redelivery's result is the same
            return
        seen.add(msg.subject)
        count(outcomes, json.loads(msg.data))
        if len(seen) == len(uris) and not done.done():
            done.set_result(time.perf_counter())

    sub = await js._nc.subscribe(job_results_subject(job), cb=on_result)
    try:
        started = time.perf_counter()
        await publish_tasks(js, settings, pipeline, make_tasks(job, uris))
        elapsed = await asyncio.wait_for(done, 1800) - started
    finally:
        await sub.unsubscribe()
    outcomes.check(len(uris))
    return elapsed


def count(outcomes: Outcomes, result: dict[str, Any]) -> None:
    """One stored result counted: ``ok`` with detections in its response (or in the object
    a response too large for a message went to), or the error it carries."""
    response = result.get("response")
    if result.get("status") == "ok" and (
        (response is not None and response.get("detections"))
        or (response is None and result.get("response_object"))
    ):
        outcomes.good()
    elif result.get("status") == "ok":
        outcomes.bad("no_detections", f"an ok result with no detections: {str(result)[:200]}")
    else:
        error = result.get("error") or {}
        outcomes.bad(str(error.get("kind", "not_ok")), str(error.get("message", result))[:300])


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
        outcomes = Outcomes(f"one-image job {n}")
        count(outcomes, result)
        outcomes.check(1)
        latency = stored_at - started
        work = result["timings_s"].get("load_s", 0) + result["timings_s"].get("infer_s", 0)
        latencies.append(latency)
        overheads.append(latency - work)
        await asyncio.sleep(0.05)
    return {"one_image_latency_s": median(latencies), "per_job_overhead_s": median(overheads)}


def pattern(w: World, name: str, uris_file: str, expected: int) -> dict[str, float]:
    """One run of a pattern of ``bench.patterns`` in its own process; ``BenchmarkFailed``
    unless it exited 0 having classified all ``expected`` images."""
    result, peak_bytes = last_json_line(
        [sys.executable, "-m", "bench.patterns", name, uris_file, w.s3.endpoint_url, w.weights],
        f"pattern {name}",
        timeout_s=1800,
    )
    outcomes = Outcomes(f"pattern {name}")
    outcomes.good(result["classified"])
    outcomes.check(expected)
    return {
        "images_per_s": result["images_per_s"],
        "cpu_ms_per_image": result["cpu_ms_per_image"],
        "peak_rss_bytes": peak_bytes,
    }


def chart(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loader = result["loader_alone"]
    patterns = result["patterns"]
    bars_of = [
        ("loader alone\n(default: reduced)", loader["default"]["images_per_s"], "#999"),
        ("loader alone\n(fast)", loader["fast"]["images_per_s"], "#bbb"),
        ("loader alone\n(exact)", loader["exact"]["images_per_s"], "#bbb"),
        ("worker (e2e)", result["end_to_end"]["images_per_s"], "#2a7"),
        ("(a) fork rebuilt\nfull-res f32", patterns["fork_rebuilt"]["images_per_s"], "#c55"),
        ("(b) DataLoader\nnum_workers=0", patterns["no_workers"]["images_per_s"], "#c55"),
        (
            "(c) forkserver rebuilt\nno preload",
            patterns["forkserver_rebuilt"]["images_per_s"],
            "#c55",
        ),
    ]
    fig, ax = plt.subplots(figsize=(11, 4.8))
    bars = ax.bar([b[0] for b in bars_of], [b[1] for b in bars_of], color=[b[2] for b in bars_of])
    ax.bar_label(bars, fmt="%.1f")
    ax.set_ylabel("images/s (median)")
    ax.set_title(
        f"{result['tasks_per_job']}-task jobs over {result['images']} JPEGs, "
        f"1920x1080 and 4096x2160; {result['machine']['cores']} cores, CPU; {result['date']}\n"
        f"model alone {result['model_alone_images_per_s']:.0f} images/s; worker / slower stage "
        f"= {result['ratio_end_to_end_to_slower_stage']:.2f} (median of rounds)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def stages(
    w: World, uris: list[str], images: int, tasks: int, runs: int, smoke: bool = False
) -> dict[str, Any]:
    """The run's settings and the stages' figures (``bench.stages`` stops here)."""
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


async def run(images: int, tasks: int, runs: int, smoke: bool = False) -> dict[str, Any]:
    with world() as w:
        distinct = upload(w.s3.client(), "throughput", SIZES, images)
        uris = cycle(distinct, tasks)
        uris_file = w.workdir / "uris.json"
        uris_file.write_text(json.dumps(distinct))
        result = await stages(w, uris, images, tasks, runs, smoke)
        result["patterns"] = {}
        names = ["fork_rebuilt", "no_workers", "forkserver_rebuilt"]
        for name in names[:1] if smoke else names:  # the smoke: one pattern's outcomes
            runs_of = [
                pattern(w, name, str(uris_file), len(distinct))
                for _ in range(min(runs, PATTERN_RUNS))  # minutes each; three are plenty
            ]
            result["patterns"][name] = {
                "images_per_s": median([one["images_per_s"] for one in runs_of]),
                "cpu_ms_per_image": median([one["cpu_ms_per_image"] for one in runs_of]),
                "peak_rss_bytes": max(one["peak_rss_bytes"] for one in runs_of),
            }
    return result


@refusing
def main() -> None:
    result, path, smoke = run_benchmark("throughput", run)
    if not smoke:  # matplotlib is in the [bench] extra, not in the test suite's
        chart(result, str(path.with_suffix(".png")))


if __name__ == "__main__":
    main()
