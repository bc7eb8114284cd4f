"""The one prepared GPU measurement (issue 13): a few minutes, one command, JSON on stdout.

    .venv/bin/python -m bench.gpu            # on the GPU host (CUDA), 5-7 minutes at most
    .venv/bin/python -m bench.gpu --quick --device cpu   # a smoke run of the same code

Prints, per case: images/s; the share of the wall time the GPU was busy (kernel time from
torch.profiler over the measured window); the time the engine waited on host-to-device copies
(``Runner.copies``); the share of images already on the device when their batch started
(copied ahead while the one before ran); device memory peak. First, whether images copied
ahead on the side stream give the same results as images copied as their batch runs. Then
detect-and-classify on 4096x2160 JPEGs (FasterRCNN ResNet-50 FPN, its top 30 boxes, then two
ResNet-50s on the crops) fed by the loader, decoded on the CPU and on the GPU
(WORKER_LOADER__DEVICE_DECODE), float32's pair first: the nvJPEG comparison is the figure a
short budget must not lose. Then the host's own work per batch (a linear model over 1000
classes), a ResNet-50 classifier alone (batch 16 and 64, float32 and bfloat16), and the same
fed by the worker's own loader children decoding 1080p JPEGs (the "GPU busy >= 90%" goal).
Each case prints one
JSON line, or its error; no new case starts after ``--budget-s``; ``--seconds`` shortens each
case's measured window (the GPU kit's run, bench/gpukit, passes 5).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.outcomes import BenchmarkFailed, refusing
from bench.preprocess import scene
from datasets.images import Decoded, DecodePlan, decode
from datasets.loader import LoaderConfig, StreamingLoader
from datasets.uris import SourceConfig
from pipelines.declare import Classifier, Detector, Pipeline, Preprocess
from pipelines.found import Detection
from pipelines.models import save_classifier, save_detector
from pipelines.response import ResponseFormat
from pipelines.runner import DeviceLimits, Runner, load_runner
from worker.engine import Engine


def busy_share(work: Callable[[], int], seconds: float, device: str) -> dict[str, float]:
    """Run ``work`` (returns images done) for ``seconds``; images/s and the GPU busy share."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        activities = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            started, done = time.perf_counter(), 0
            while time.perf_counter() - started < seconds:
                done += work()
            torch.cuda.synchronize()
            wall = time.perf_counter() - started
        kernel_us = sum(e.self_device_time_total for e in prof.key_averages())
        return {
            "images_per_s": round(done / wall, 1),
            "gpu_busy_share": round(min(1.0, kernel_us / 1e6 / wall), 3),
            "peak_memory_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1),
        }
    started, done = time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        done += work()
    return {"images_per_s": round(done / (time.perf_counter() - started), 1)}


_SAVED: dict[str, str] = {}


def saved(tmp: Path, name: str, make: Callable[[str], str]) -> str:
    """Weights written once per run, whatever the number of cases that load them."""
    if name not in _SAVED:
        _SAVED[name] = make(str(tmp / name))
    return _SAVED[name]


def classifier(tmp: Path, device: str, precision: str, crop_batch: int) -> Runner:
    labels = [f"s{i}" for i in range(1000)]
    weights = saved(tmp, "cls", lambda d: save_classifier("resnet50", labels, d))
    stage = Classifier("species", architecture="resnet50", weights=weights)
    limits = DeviceLimits(crop_batch=crop_batch)
    fmt = ResponseFormat(scores="top_k", top_k=5)
    runner = load_runner(
        Pipeline("cls", classifier=stage), SourceConfig(), device, limits, fmt, precision
    )
    runner.measure_copies = True
    return runner


def moths(tmp: Path) -> Pipeline:
    """Detect and classify (FasterRCNN ResNet-50 FPN, its top 30 boxes whatever their score,
    then two ResNet-50s on the crops), random weights written under ``tmp`` once."""

    def resnet(name: str, labels: list[str]) -> str:
        return saved(tmp, name, lambda d: save_classifier("resnet50", labels, d))

    return Pipeline(
        "moths",
        detector=Detector(
            "detector",
            architecture="fasterrcnn_resnet50_fpn",
            weights=saved(
                tmp, "det", lambda d: save_detector("fasterrcnn_resnet50_fpn", ["moth"], d)
            ),
            labels=None,
            score_threshold=0.0,  # random weights: keep the top 30 boxes whatever their score
            max_detections=30,
        ),
        filter=Classifier(
            "binary",
            architecture="resnet50",
            weights=resnet("bin", ["moth", "nonmoth"]),
            keep=("moth", "nonmoth"),
            preprocess=Preprocess(128),
        ),
        classifier=Classifier(
            "species",
            architecture="resnet50",
            weights=resnet("sp", [f"s{i}" for i in range(1000)]),
            preprocess=Preprocess(128),
        ),
    )


def detect_and_classify(tmp: Path, device: str, precision: str) -> Runner:
    limits = DeviceLimits(detector_batch=4, crop_batch=256, max_side=4096)
    fmt = ResponseFormat(scores="top_k")
    runner = load_runner(moths(tmp), SourceConfig(), device, limits, fmt, precision)
    runner.measure_copies = True
    return runner


def loader_config(files: list[Path], plan: DecodePlan, batch: int, workers: int) -> LoaderConfig:
    """Loader children reading ``files``, with room for three batches ahead."""
    return LoaderConfig(
        num_workers=workers,
        timeout_s=120,
        plan=plan,
        sources=SourceConfig(file_roots=(str(files[0].parent),)),
        prefetch_per_worker=-(-3 * batch // workers) + 1,
    )


def fed_by_loader(
    runner: Runner, files: list[Path], plan: DecodePlan, batch: int, seconds: float, device: str
) -> dict[str, Any]:
    """The worker's own engine and loader children over ``files`` (cycled), ``batch`` a time."""
    workers = max(2, min(14, (os.cpu_count() or 4) - 2))
    engine = Engine(StreamingLoader(loader_config(files, plan, batch, workers)), runner)
    engine.start()
    next_key = 0

    def submit() -> list[int]:
        nonlocal next_key
        keys = list(range(next_key, next_key + batch))
        next_key += batch
        engine.submit([(k, f"file://{files[k % len(files)]}") for k in keys])
        return keys

    pending = [submit(), submit()]  # the loader runs ahead by two batches, as the worker does
    failures: dict[str, int] = {}

    def work() -> int:
        keys = pending.pop(0)
        pending.append(submit())
        report = engine.run_batch(keys)
        for verdict in report.outcomes.values():
            if verdict.failure is not None:
                kind = verdict.failure.kind
                failures[kind] = failures.get(kind, 0) + 1
        return sum(1 for v in report.outcomes.values() if v.ok)

    try:
        work()  # warm-up: children started, first batches loaded
        runner.copies.waited_s = 0.0
        ran_before, copied_ahead_before = next_key - 2 * batch, engine.ran_copied_ahead
        measured: dict[str, Any] = dict(busy_share(work, seconds, device))
        if failures:  # a rate of failures is no rate: the case reports the error instead
            raise BenchmarkFailed(f"images failed in the loader or the engine: {failures}")
        # Of the images run, the share already on the device when their batch started (its
        # first chunk can be at most runner.copy_ahead_images of them).
        ran = next_key - 2 * batch - ran_before
        copied_ahead = engine.ran_copied_ahead - copied_ahead_before
        copy_wait_s = runner.copies.waited_s
    finally:
        engine.close()
    return {
        **measured,
        "copy_wait_s": round(copy_wait_s, 3),
        "copied_ahead_share": round(copied_ahead / max(1, ran), 3),
        "loader_children": workers,
        "failures": failures,
    }


def same_copied_ahead(runner: Runner, images: list[Decoded]) -> dict[str, Any]:
    """The copies are right: results of images copied ahead on the side stream while another batch
    runs, against the same images copied as their batch runs (boxes, labels, scores)."""
    plain = runner.run(images)
    copied: list[list[Decoded]] = []
    runner.run(images, lambda: copied.append(runner.copy_ahead(images)))
    again = runner.run(copied[0])

    def flat(results: list[list[Detection]]) -> tuple[list[Any], list[float]]:
        """Every box and label, in order; every score."""
        found = [d for per_image in results for d in per_image]
        classified = [c for d in found for c in d.classifications]
        same = [d.bbox for d in found] + [c.labels for c in classified]
        return same, [x for c in classified for x in c.scores]

    (same_a, scores_a), (same_b, scores_b) = flat(plain), flat(again)
    differences = [abs(x - y) for x, y in zip(scores_a, scores_b, strict=False)]
    return {
        "images": len(images),
        "same_boxes_and_labels": same_a == same_b,
        "max_score_difference": max(differences, default=0.0),
    }


def host_work(tmp: Path, device: str, squares: list[Decoded], seconds: float) -> dict[str, Any]:
    """What the host spends per batch besides the model: a linear classifier over 1000
    classes, full scores written, 64 images a batch (the gap the GPU waits through)."""
    labels = [f"s{i}" for i in range(1000)]
    stage = Classifier("linear", architecture=Linear, labels=tuple(labels))
    runner = load_runner(Pipeline("linear", classifier=stage), SourceConfig(), device)
    images = [squares[i % len(squares)] for i in range(64)]
    runner.run(images)
    measured = busy_share(lambda: len(runner.run(images)), seconds, device)
    measured["host_ms_per_batch"] = round(64_000 / measured["images_per_s"], 2)
    return measured


class Linear(torch.nn.Module):
    """A model that costs next to nothing: the host's own work is what is left."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.head = torch.nn.Linear(3, num_classes)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.head(batch.mean(dim=(2, 3)))


_ERRORS: list[str] = []


def case(row: dict[str, Any], measure: Callable[[], dict[str, Any]], deadline: float) -> None:
    """One case: its JSON line with the measurement, or with the error that stopped it (the
    run then exits 1, after the other cases)."""
    if time.monotonic() > deadline:
        row["skipped"] = "past --budget-s"
    else:
        try:
            row.update(measure())
        except Exception as error:  # noqa: BLE001 - one case's failure must not hide the rest
            row["error"] = f"{type(error).__name__}: {error}"[:500]
            _ERRORS.append(f"{row.get('case')}: {row['error']}")
    print(json.dumps(row), flush=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@refusing
def main() -> None:
    run_cases()
    if _ERRORS:
        raise BenchmarkFailed(f"{len(_ERRORS)} case(s) failed; first: {_ERRORS[0]}")


@dataclass(frozen=True)
class Run:
    """What every case of one run shares."""

    tmp: Path
    device: str
    quick: bool
    seconds: float
    deadline: float


def parse() -> tuple[argparse.Namespace, float]:
    """The command line, and each case's measured window."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--budget-s", type=float, default=420.0, help="no new case after this")
    parser.add_argument(
        "--seconds",
        type=float,
        help="each case's measured window (the 4K cases twice it); 10, or 2 with --quick",
    )
    args = parser.parse_args()
    return args, args.seconds or (2.0 if args.quick else 10.0)


def scenes_in(folder: Path, count: int, width: int, height: int, seed: int) -> list[Path]:
    """``count`` generated scenes written as JPEGs in ``folder`` (made)."""
    folder.mkdir()
    paths = []
    for i in range(count):
        path = folder / f"{i}.jpg"
        path.write_bytes(scene(width, height, seed + i))
        paths.append(path)
    return paths


def run_cases() -> None:
    args, seconds = parse()
    deadline = time.monotonic() + args.budget_s
    on_gpu = args.device.startswith("cuda")
    torch.set_num_threads(2)  # as the worker does: the cores are the loader children's
    info = {"device": args.device, "torch": torch.__version__, "cpus": os.cpu_count()}
    if on_gpu:
        info["gpu"] = torch.cuda.get_device_name(0)
    print(json.dumps(info), flush=True)
    with tempfile.TemporaryDirectory() as tmp_name:
        run = Run(Path(tmp_name), args.device, args.quick, seconds, deadline)
        files = scenes_in(run.tmp / "1080p", 8 if args.quick else 96, 1920, 1080, 0)
        squares = [decode(p.read_bytes(), DecodePlan(size=224)) for p in files[:16]]
        if on_gpu or args.quick:
            copied_ahead_checks(run, files, squares)
        scenes = scenes_in(run.tmp / "4k", 2 if args.quick else 16, 4096, 2160, 100)
        detect_cases(run, scenes)
        case(
            {"case": "host work per batch of 64 (1000 classes)"},
            lambda: host_work(run.tmp, args.device, squares, seconds),
            deadline,
        )
        classifier_cases(run, files, squares)


def copied_ahead_checks(run: Run, files: list[Path], squares: list[Decoded]) -> None:
    """Images copied ahead give what images copied as their batch runs give."""
    scenes_1080p = [decode(p.read_bytes(), DecodePlan(max_side=4096)) for p in files[:4]]
    checks = {
        "classifier": lambda: same_copied_ahead(
            classifier(run.tmp, run.device, "float32", crop_batch=8),
            [squares[i % len(squares)] for i in range(32)],
        ),
        "detect and classify": lambda: same_copied_ahead(
            detect_and_classify(run.tmp, run.device, "float32"), scenes_1080p
        ),
    }
    for name, check in checks.items():
        case({"case": f"copied ahead equals not, {name}"}, check, run.deadline)


def detect_cases(run: Run, scenes: list[Path]) -> None:
    """4K detect-and-classify fed by the loader, CPU and GPU decode, float32 then bfloat16."""
    batch = 1 if run.quick else 16
    for precision in ("float32", "bfloat16"):  # float32 CPU and GPU decode first
        for gpu_decode in (False, True):

            def detect(precision: str = precision, gpu_decode: bool = gpu_decode) -> dict[str, Any]:
                runner = detect_and_classify(run.tmp, run.device, precision)
                plan = DecodePlan(max_side=4096, encoded=gpu_decode)
                return fed_by_loader(runner, scenes, plan, batch, run.seconds * 2, run.device)

            where = "GPU" if gpu_decode else "CPU"
            row: dict[str, Any] = {"case": f"detect and classify, {where} decode (4K)"}
            row["precision"] = precision
            row["batch"] = batch
            case(row, detect, run.deadline)


def classifier_cases(run: Run, files: list[Path], squares: list[Decoded]) -> None:
    """The classifier alone on ready images, then fed by the loader, in both precisions."""
    for precision in ("float32", "bfloat16"):
        for batch in (2, 4) if run.quick else (16, 64):

            def alone(precision: str = precision, batch: int = batch) -> dict[str, Any]:
                runner = classifier(run.tmp, run.device, precision, crop_batch=32)
                images = [squares[i % len(squares)] for i in range(batch)]

                copied = [runner.copy_ahead(images)]

                def forward() -> int:
                    # As the engine does: the next batch is copied ahead while this one runs.
                    runner.run(copied.pop(), lambda: copied.append(runner.copy_ahead(images)))
                    return len(images)

                forward()
                return busy_share(forward, run.seconds, run.device)

            row = {"case": "classifier alone", "precision": precision, "batch": batch}
            case(row, alone, run.deadline)
    for precision in ("float32", "bfloat16"):
        batch = 4 if run.quick else 64

        def fed(precision: str = precision, batch: int = batch) -> dict[str, Any]:
            runner = classifier(run.tmp, run.device, precision, crop_batch=batch)
            plan = DecodePlan(size=224)
            return fed_by_loader(runner, files, plan, batch, run.seconds, run.device)

        row = {"case": "classifier fed by the loader (1080p JPEG)", "precision": precision}
        row["batch"] = batch
        case(row, fed, run.deadline)


if __name__ == "__main__":
    main()
