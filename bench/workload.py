"""The real workload end to end on this machine's CPU: detect-and-classify on 4096x2160 JPEGs.

The pipeline: the fast CPU detector (``fasterrcnn_mobilenet_v3_large_fpn``, its top
``--boxes`` boxes whatever their random scores, so the crop stages see that many), crops cut at
source resolution, a binary filter and a species classifier (ResNet-50, 128 px; the filter
keeps every crop: the worst case). Measured in one run, interleaved round by round:

- the loader alone: the worker's ``StreamingLoader`` (``--loader-workers`` children) making
  the detector's input (the image bounded by ``MAX_SIDE``);
- the models alone: the pipeline's own ``Runner`` on images decoded beforehand;
- ``inference-worker run`` with the pipeline declared in TOML, publish to the job's last
  stored result;

then AMI's pattern on the same images (``bench.common.ami_pattern``: a DataLoader rebuilt per job,
full-resolution float32 tensors, one stacked crop batch per job). Every stage counts its
outcomes (an image of the right shape, a result with detections) before a rate is reported.
Images/s, CPU ms per image (process CPU of the stage's processes) and peak RSS of each
stage's process tree. Writes bench/results/workload.json.

    .venv/bin/python -m bench.workload [--images 8] [--runs 2] [--boxes 20]
    .venv/bin/python -m bench.workload --smoke     # outcomes only (the test suite runs it)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from bench.common.meters import PeakRss, TreeCpu, last_json_line, machine, median, tree
from bench.common.records import save, stamp
from bench.common.stages import take_loaded
from bench.common.world import World, start_worker, stop_worker, world
from bench.outcomes import Outcomes, refusing
from bench.preprocess import scene
from datasets.images import Decoded, DecodePlan
from pipelines.models import save_classifier, save_detector

DETECTOR = "fasterrcnn_mobilenet_v3_large_fpn"
CLASSIFIER = "resnet50"
CROP_SIZE = 128


@dataclass(frozen=True)
class Shape:
    images: int
    width: int
    height: int
    boxes: int
    species: int
    runs: int
    loader_workers: int
    torch_threads: int
    batch: int
    classifier: str = CLASSIFIER
    detector_min_size: int = 800  # torchvision's defaults: shorter side 800, longer <= 1333
    detector_max_size: int = 1333


def declare(workdir: Path, shape: Shape) -> tuple[Path, dict[str, str]]:
    """The pipeline as a TOML file beside its (random) weights; and the weights' paths."""
    weights = {
        "detector": save_detector(DETECTOR, ["moth"], str(workdir / "detector")),
        "binary": save_classifier(shape.classifier, ["moth", "nonmoth"], str(workdir / "binary")),
        "species": save_classifier(
            shape.classifier, [f"s{i}" for i in range(shape.species)], str(workdir / "species")
        ),
    }
    toml = workdir / "moths.toml"
    toml.write_text(
        f"""name = "moths"

[detector]
key = "detector"
architecture = "{DETECTOR}"
weights = "{weights["detector"]}"
score_threshold = 0.0
max_detections = {shape.boxes}
min_size = {shape.detector_min_size}
max_size = {shape.detector_max_size}

[filter]
key = "binary"
architecture = "{shape.classifier}"
weights = "{weights["binary"]}"
keep = ["moth", "nonmoth"]
preprocess = {{ size = {CROP_SIZE} }}

[classifier]
key = "species"
architecture = "{shape.classifier}"
weights = "{weights["species"]}"
preprocess = {{ size = {CROP_SIZE} }}
"""
    )
    return toml, weights


def upload_scenes(w: World, shape: Shape) -> list[str]:
    s3 = w.s3.client()
    s3.create_bucket(Bucket="workload")
    uris = []
    for i in range(shape.images):
        key = f"scene-{i:03d}.jpg"
        s3.put_object(Bucket="workload", Key=key, Body=scene(shape.width, shape.height, i))
        uris.append(f"s3://workload/{key}")
    return uris


class Loader:
    """The worker's loader alone, making the detector's input; outcomes checked."""

    def __init__(self, w: World, plan: DecodePlan, shape: Shape) -> None:
        from datasets.loader import LoaderConfig, StreamingLoader
        from datasets.uris import SourceConfig

        self.expected = (3, shape.height, shape.width)
        sources = SourceConfig(s3_endpoint_url=w.s3.endpoint_url)
        self.loader = StreamingLoader(
            LoaderConfig(shape.loader_workers, 120.0, plan, sources, prefetch_per_worker=4)
        )
        self.cpu = TreeCpu(self.loader.child_pids)
        self._keys = 0

    def load(self, uris: list[str]) -> tuple[float, list[Decoded]]:
        outcomes = Outcomes("loader alone (detector input)")
        started = time.perf_counter()
        with self.cpu:
            images = take_loaded(self.loader, self._keys, uris, self.expected, outcomes)
            self._keys += len(uris)
        elapsed = time.perf_counter() - started
        outcomes.check(len(uris))
        return elapsed, images


def models_alone(runner: Any, images: list[Decoded], batch: int, boxes: int) -> float:
    """Seconds for the pipeline's models on ``images``, ``batch`` at a time; every image must
    come back with detections, each classified by both classifiers."""
    outcomes = Outcomes("models alone (detect and classify)")
    started = time.perf_counter()
    for first in range(0, len(images), batch):
        for found in runner.run(images[first : first + batch]):
            classified = [d for d in found if len(d.classifications) == 2]
            if found and len(classified) == len(found) and len(found) <= boxes:
                outcomes.good()
            else:
                outcomes.bad("detections", f"{len(found)} detections, {len(classified)} classified")
    elapsed = time.perf_counter() - started
    outcomes.check(len(images))
    return elapsed


def ami(w: World, uris: list[str], weights: dict[str, str], shape: Shape) -> dict[str, Any]:
    config = {
        "uris": uris,
        "endpoint": w.s3.endpoint_url,
        "detector_architecture": DETECTOR,
        "classifier_architecture": shape.classifier,
        "detector_weights": weights["detector"],
        "binary_weights": weights["binary"],
        "species_weights": weights["species"],
        "species": shape.species,
        "boxes": shape.boxes,
        "detector_min_size": shape.detector_min_size,
        "detector_max_size": shape.detector_max_size,
        "size": CROP_SIZE,
        "runs": shape.runs,
        "torch_threads": shape.torch_threads,
    }
    path = w.workdir / "ami.json"
    path.write_text(json.dumps(config))
    result, peak_bytes = last_json_line(
        [sys.executable, "-m", "bench.common.ami_pattern", str(path)],
        "AMI's pattern",
        timeout_s=3600,
    )
    outcomes = Outcomes("AMI's pattern")
    outcomes.good(result["images_with_detections"])
    outcomes.check(result["images"])
    rates = [len(uris) / s for s in result["seconds"]]
    return {
        "images_per_s": median(rates),
        "runs_images_per_s": rates,
        "crops_classified": result["crops_classified"],
        "cpu_ms_per_image": round(result["cpu_ms_per_image"], 1),
        "peak_rss_bytes": peak_bytes,
    }


def start_workload_worker(w: World, toml: Path, shape: Shape) -> Any:
    """``inference-worker run`` serving the declared pipeline, with room for slow batches."""
    return start_worker(
        w,
        "workload-worker.log",
        WORKER_MODEL__PIPELINE=str(toml),
        WORKER_MODEL__WEIGHTS="",
        WORKER_MODEL__TORCH_THREADS=str(shape.torch_threads),
        WORKER_MODEL__DETECTOR_BATCH_SIZE=str(shape.batch),
        WORKER_LOADER__BATCH_SIZE=str(shape.batch),
        WORKER_LOADER__NUM_WORKERS=str(shape.loader_workers),
        WORKER_LOADER__TIMEOUT_S="120",
        WORKER_HEALTH__STALL_TIMEOUT_S="600",
        WORKER_HEALTH__WATCHDOG_TIMEOUT_S="900",
        WORKER_NATS__ACK_WAIT_S="1200",
    )


@dataclass
class Meters:
    """What each stage is measured by."""

    loader: TreeCpu
    models: TreeCpu
    worker: TreeCpu
    loader_peak: PeakRss
    worker_peak: PeakRss


async def rounds_of(
    w: World, shape: Shape, uris: list[str], toml: Path
) -> tuple[list[dict[str, float]], Meters, int]:
    """The three stages interleaved, round by round (the first warms up): their rates, their
    meters, and the benchmark process's RSS after the models ran alone."""
    from bench.common.job_runs import client, run_job
    from bench.common.world import nats_settings
    from datasets.uris import SourceConfig
    from pipelines.registry import resolve
    from pipelines.runner import DeviceLimits, decode_plan, load_runner

    pipeline = resolve(str(toml))
    torch.set_num_threads(shape.torch_threads)
    runner = load_runner(pipeline, SourceConfig(), "cpu", DeviceLimits(detector_batch=shape.batch))
    settings, rounds = nats_settings(w), []
    async with client(settings, pipeline.name) as nc:
        proc = start_workload_worker(w, toml, shape)
        loader = Loader(w, decode_plan(pipeline, 4096, fast=False), shape)
        loader.loader.start()
        me = psutil.Process()
        meters = Meters(
            loader.cpu, TreeCpu(lambda: [me.pid]), TreeCpu(tree(proc.pid)),
            PeakRss(pids=loader.loader.child_pids), PeakRss(proc.pid),
        )  # fmt: skip
        try:
            with meters.worker_peak, meters.loader_peak:
                for run in range(shape.runs + 1):  # the first round warms up
                    with meters.loader if run else unmeasured():
                        loader_s, images = loader.load(uris)
                    with meters.models if run else unmeasured():
                        models_s = models_alone(runner, images, shape.batch, shape.boxes)
                    del images
                    with meters.worker if run else unmeasured():
                        worker_s = await run_job(nc, settings, f"w-{run}", uris, pipeline.name)
                    if run:
                        rounds.append(one_round(len(uris), loader_s, models_s, worker_s))
        finally:
            loader.loader.close()
            stop_worker(proc)
    # The benchmark's process holds the models and moto's S3 while the models run alone.
    return rounds, meters, me.memory_info().rss


async def measured(shape: Shape) -> dict[str, Any]:
    with world() as w:
        toml, weights = declare(w.workdir, shape)
        uris = upload_scenes(w, shape)
        rounds, meters, models_peak = await rounds_of(w, shape, uris, toml)
        amis = ami(w, uris, weights, shape)
    n = len(uris) * shape.runs
    end_to_end = median([r["end_to_end_images_per_s"] for r in rounds])
    return {
        "rounds": rounds,
        "loader_alone": {
            "images_per_s": median([r["loader_images_per_s"] for r in rounds]),
            "children_cpu_ms_per_image": meters.loader.ms_per_image(n),
            "children_peak_rss_bytes": meters.loader_peak.peak_bytes,
        },
        "models_alone": {
            "images_per_s": median([r["models_images_per_s"] for r in rounds]),
            "cpu_ms_per_image": meters.models.ms_per_image(n),
            "benchmark_process_rss_bytes": models_peak,
        },
        "end_to_end": {
            "images_per_s": end_to_end,
            "tree_cpu_ms_per_image": meters.worker.ms_per_image(n),
            "peak_rss_bytes": meters.worker_peak.peak_bytes,
        },
        "ratio_end_to_end_to_slower_stage": median([r["ratio"] for r in rounds]),
        "ami_pattern": amis,
        "end_to_end_to_ami": round(end_to_end / amis["images_per_s"], 2),
    }


def unmeasured() -> TreeCpu:
    """A meter of no process: the warm-up round is not counted."""
    return TreeCpu(lambda: [])


def one_round(n: int, loader_s: float, models_s: float, worker_s: float) -> dict[str, float]:
    return {
        "loader_images_per_s": n / loader_s,
        "models_images_per_s": n / models_s,
        "end_to_end_images_per_s": n / worker_s,
        "ratio": max(loader_s, models_s) / worker_s,
    }


@refusing
def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--boxes", type=int, default=20)
    parser.add_argument("--species", type=int, default=1000)
    parser.add_argument("--loader-workers", type=int, default=1)
    parser.add_argument("--torch-threads", type=int, default=2)
    parser.add_argument(
        "--batch", type=int, default=4, help="tasks per batch, images per detector pass"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny and quick: outcomes only")
    args = parser.parse_args()
    width, height, classifier = 4096, 2160, CLASSIFIER
    if args.smoke:
        args.images, args.runs, args.boxes, args.species = 2, 1, 2, 10
        width, height, classifier = 1280, 720, "resnet18"
    shape = Shape(
        args.images,
        width,
        height,
        args.boxes,
        args.species,
        args.runs,
        args.loader_workers,
        args.torch_threads,
        args.batch,
        classifier,
        *((320, 576) if args.smoke else ()),
    )
    result: dict[str, Any] = {
        "machine": machine(),
        "shape": shape.__dict__,
        "detector": DETECTOR,
        "classifiers": f"{classifier} x2 at {CROP_SIZE} px",
        **stamp("workload"),
    }
    result.update(asyncio.run(measured(shape)))
    print("saved", save("workload", result, echo=True))


if __name__ == "__main__":
    main()
