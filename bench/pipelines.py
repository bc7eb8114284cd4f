"""Several pipelines and jobs in one process (README, "Several pipelines in one process",
"Fair share across jobs"). Four cases, each checking its own outcomes before it reports:

    .venv/bin/python -m bench.pipelines [--cases switch,interleaved,fairness,memory]

- ``switch``: what a model switch costs: a cache hit, a load from disk, a load from S3 (the
  local S3 endpoint); the loaded models must give the same logits and sha256.
- ``interleaved``: images/s of two pipelines' jobs run together in one worker, against each
  alone (every result ok, each from its own pipeline).
- ``fairness``: a 5-task job published right after a 240-task job: when its last result is
  stored, as a share of the big job's time, with ``WORKER_NATS__FAIR_JOBS`` false (stream
  order) and true (a consumer per job); every task exactly one result.
- ``memory``: 10 classifier pipelines served in turn under a budget that fits 3: pipelines
  resident, their bytes, and the worker's resident memory, against a budget that fits all 10.

Writes bench/results/pipelines.json.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.common import machine, save, start_worker, stop_worker, upload, world
from worker.commands.client import job_results, make_tasks, publish_tasks
from worker.nats.connection import connect

SIZES = [(640, 480), (1280, 720), (1024, 768)]
ARCH = "resnet18"


def _declare(directory: Path, name: str, seed: int, arch: str = ARCH) -> str:
    from pipelines.models import save_classifier

    labels = [f"{name}-{i}" for i in range(10)]
    weights = save_classifier(arch, labels, str(directory / name), seed=seed)
    toml = directory / f"{name}.toml"
    toml.write_text(
        f'name = "{name}"\n[classifier]\nkey = "{name}"\narchitecture = "{arch}"\n'
        f'weights = "{weights}"\n'
    )
    return str(toml)


def switch(w: Any) -> dict[str, Any]:
    """Model switch cost, in-process: cache hit, load from disk, load from S3."""
    import torch

    from datasets.sources import SourceConfig
    from pipelines.cache import ModelCache
    from pipelines.registry import resolve
    from pipelines.runner import Runner, load_runner

    disk_toml = _declare(w.workdir, "switch", seed=5)
    weights = w.workdir / "switch" / "model.pt"
    s3 = w.s3.client()
    s3.create_bucket(Bucket="models")
    s3.upload_file(str(weights), "models", "switch/model.pt")
    s3.upload_file(str(weights.parent / "labels.txt"), "models", "switch/labels.txt")
    sources = SourceConfig(s3_endpoint_url=w.s3.endpoint_url)
    disk = resolve(disk_toml)
    from dataclasses import replace

    assert disk.classifier is not None
    on_s3 = replace(
        disk,
        classifier=replace(disk.classifier, weights="s3://models/switch/model.pt", labels=None),
    )
    pipelines = {"disk": disk, "s3": on_s3}

    def load(name: str) -> Runner:
        return load_runner(pipelines[name], sources, "cpu")

    cache: ModelCache[Runner] = ModelCache(load, Runner.weights_bytes, 1 << 40)
    timings: dict[str, list[float]] = {"disk": [], "s3": [], "hit": []}
    for _ in range(3):
        for name in ("disk", "s3"):
            cache.close()  # unloaded: the next acquire loads
            started = time.perf_counter()
            cache.acquire(name)
            timings[name].append(time.perf_counter() - started)
            cache.release(name)
    for _ in range(200):
        started = time.perf_counter()
        cache.acquire("s3")
        timings["hit"].append(time.perf_counter() - started)
        cache.release("s3")
    cache.load("disk")
    a, b = cache.peek("disk"), cache.peek("s3")
    assert a is not None and b is not None
    batch = torch.randint(0, 255, (4, 3, 224, 224), dtype=torch.uint8)
    assert a.classifier is not None and b.classifier is not None
    same = torch.equal(a.classifier.logits(batch), b.classifier.logits(batch))
    sha = hashlib.sha256(weights.read_bytes()).hexdigest()
    assert same and a.algorithms()[0].weights_sha256 == b.algorithms()[0].weights_sha256 == sha
    return {
        "architecture": ARCH,
        "model_bytes": a.weights_bytes(),
        "cache_hit_s": sorted(timings["hit"])[len(timings["hit"]) // 2],
        "load_from_disk_s": sorted(timings["disk"])[1],
        "load_from_s3_s": sorted(timings["s3"])[1],
        "same_logits": same,
    }


async def _run_jobs(w: Any, jobs: dict[str, tuple[str, list[str]]]) -> dict[str, Any]:
    """Publish ``jobs`` (job -> (pipeline, uris)) at once to a running worker; per job the
    seconds from publishing to its last result, and its results."""
    nc = await connect(_nats(w), name="bench", give_up_after_s=30)
    js = nc.jetstream()
    settings = _nats(w)
    started = time.monotonic()
    tasks = {}
    for job, (pipeline, uris) in jobs.items():
        tasks[job] = make_tasks(job, uris)
        await publish_tasks(js, settings, pipeline, tasks[job])
    done: dict[str, float] = {}
    results: dict[str, list[dict[str, Any]]] = {}
    deadline = started + 900
    while len(done) < len(jobs):
        assert time.monotonic() < deadline, "jobs did not finish in 900 s"
        for job in jobs:
            if job in done:
                continue
            got = await job_results(js, settings, job)
            if len(got) >= len(tasks[job]):
                done[job], results[job] = time.monotonic() - started, got
        await asyncio.sleep(0.05)
    await nc.close()
    for job, got in results.items():
        ids = [r["task_id"] for r in got]
        assert sorted(ids) == sorted(t.id for t in tasks[job]), f"{job}: lost or duplicated"
        assert {r["status"] for r in got} == {"ok"}, f"{job}: not all ok"
        assert {r["pipeline"] for r in got} == {jobs[job][0]}, f"{job}: another pipeline answered"
    return {"seconds": done, "results": results}


def _nats(w: Any) -> Any:
    from config.settings import NatsSettings

    return NatsSettings(url=w.nats.url)


def _with_worker(w: Any, log: str, **env: str) -> Any:
    proc = start_worker(w, log, **env)
    time.sleep(0.1)
    return proc


async def interleaved(w: Any, uris: list[str]) -> dict[str, Any]:
    a, b = (
        _declare(w.workdir, "alpha", 1, "mobilenet_v3_small"),
        _declare(w.workdir, "beta", 2, "mobilenet_v3_small"),
    )
    proc = _with_worker(
        w, "interleaved.log", WORKER_MODEL__PIPELINES=f"{a},{b}", WORKER_MODEL__WEIGHTS=""
    )
    try:
        await _run_jobs(w, {"warm-a": ("alpha", uris[:8]), "warm-b": ("beta", uris[:8])})
        alone_a = await _run_jobs(w, {"alone-a": ("alpha", uris)})
        alone_b = await _run_jobs(w, {"alone-b": ("beta", uris)})
        both = await _run_jobs(w, {"both-a": ("alpha", uris), "both-b": ("beta", uris)})
    finally:
        stop_worker(proc)
    n = len(uris)
    return {
        "tasks_per_job": n,
        "alpha_alone_images_per_s": n / alone_a["seconds"]["alone-a"],
        "beta_alone_images_per_s": n / alone_b["seconds"]["alone-b"],
        "interleaved_images_per_s": 2 * n / max(both["seconds"].values()),
    }


async def fairness(w: Any, uris: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    big = (uris * (240 // len(uris) + 1))[:240]
    for fair in ("false", "true"):
        proc = _with_worker(
            w, f"fair-{fair}.log", WORKER_NATS__FAIR_JOBS=fair, WORKER_NATS__CONSUMER=f"fair-{fair}"
        )
        try:
            ran = await _run_jobs(
                w, {f"big-{fair}": (_pipeline(), big), f"small-{fair}": (_pipeline(), uris[:5])}
            )
        finally:
            stop_worker(proc)
        big_s, small_s = ran["seconds"][f"big-{fair}"], ran["seconds"][f"small-{fair}"]
        out[f"fair_jobs_{fair}"] = {
            "big_job_s": round(big_s, 2),
            "small_job_done_s": round(small_s, 2),
            "small_done_at_share_of_big": round(small_s / big_s, 3),
        }
    return out


def _pipeline() -> str:
    from bench.common import PIPELINE

    return PIPELINE


async def memory(w: Any, uris: list[str]) -> dict[str, Any]:
    import psutil

    tomls = [_declare(w.workdir, f"m{i:02d}", 10 + i) for i in range(10)]
    one = (w.workdir / "m00" / "model.pt").stat().st_size
    out: dict[str, Any] = {"pipelines": 10, "model_file_bytes": one}
    for label, budget in (("budget_fits_3", int(one * 3.5)), ("budget_fits_10", one * 11)):
        port = 19580 + (label == "budget_fits_10")
        proc = _with_worker(
            w,
            f"memory-{label}.log",
            WORKER_MODEL__PIPELINES=",".join(tomls),
            WORKER_MODEL__WEIGHTS="",
            WORKER_MODEL__MEMORY_BUDGET_BYTES=str(budget),
            WORKER_METRICS__PORT=str(port),
        )
        try:
            peak = 0
            for i in range(10):
                await _run_jobs(w, {f"{label}-m{i:02d}": (f"m{i:02d}", uris[:4])})
                peak = max(peak, psutil.Process(proc.pid).memory_info().rss)
            text = await asyncio.to_thread(_scrape, port)
            rss = psutil.Process(proc.pid).memory_info().rss
        finally:
            stop_worker(proc)
        resident = _metric(text, "inference_worker_models_resident")
        loaded = sum(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("inference_worker_model_bytes{")
        )
        evictions = sum(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("inference_worker_model_evictions_total{")
        )
        assert loaded <= budget, f"{label}: {loaded} bytes loaded over the budget {budget}"
        out[label] = {
            "budget_bytes": budget,
            "models_resident": resident,
            "model_bytes_loaded": loaded,
            "evictions": evictions,
            "main_rss_bytes_after": rss,
            "main_rss_bytes_peak": peak,
        }
    assert out["budget_fits_3"]["models_resident"] <= 3
    return out


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        return str(answer.read().decode())


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not exported")


async def run(cases: list[str], images: int) -> dict[str, Any]:
    result: dict[str, Any] = {"machine": machine()}
    with world() as w:
        uris = upload(w.s3.client(), "pipelines", SIZES, images)
        if "switch" in cases:
            result["switch"] = switch(w)
        if "interleaved" in cases:
            result["interleaved"] = await interleaved(w, uris)
        if "fairness" in cases:
            result["fairness"] = await fairness(w, uris)
        if "memory" in cases:
            result["memory"] = await memory(w, uris)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="switch,interleaved,fairness,memory")
    parser.add_argument("--images", type=int, default=48)
    args = parser.parse_args()
    result = asyncio.run(run(args.cases.split(","), args.images))
    save("pipelines", result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
