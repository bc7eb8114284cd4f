"""Where the time of AMI's ``quebec_vermont_moths_2023`` goes, stage by stage, on this machine.

    .venv/bin/python -m bench.ami_stages [--images 8] [--k4-every 2] [--threads N ...]
                                         [--mirror DIR] [--smoke]

One process, no loader children and no Antenna: each image decoded by the pipeline's own decode
plan, then run through the worker's ``Runner`` (``load_runner`` with the settings' defaults)
one image at a time, as the worker's batches run it, the C allocator set as a worker sets it
at start (``WORKER_MODEL__KEEP_FREED_MEMORY``, ``worker/process/allocator.py``). Each stage's
time is *its own* (a stage's children are subtracted), as wall seconds and as this process's
CPU seconds (every thread's: intra-op threads included), summed over the images after one
warm-up image:

- ``decode``: the JPEG decoded as the loader children decode it (``datasets.images.decode``);
- ``detector transform``, ``backbone``, ``rpn``, ``roi heads``: the Faster R-CNN's own modules
  (forward hooks); ``detector rest``: the rest of the detector's call (input to floats, the
  boxes scaled back, rows and clean-up);
- ``crops``: cutting and squashing each box's crop (``_cut``, ``_squared``);
- ``filter``, ``classifier``: the two classifiers' forward passes (normalisation included);
- ``rendering``: the per-box typed results (``response.detection``, each classification);
- ``settle (encode)``: the image's detections written and encoded as JSON, as the post to Antenna
  encodes its body (the CPU side of the settle; the local HTTP round trip is not here);
- ``other``: the rest of ``Runner.run``.

Random weights in ADC's layouts (``tests/ami_files.py``) unless ``--mirror``; made JPEGs (every
``--k4-every``-th 3840x2160, the rest 1920x1080). ``--threads`` runs the whole profile once per
value given (default: the thread count the worker chooses here at its defaults). Also
reported: the detector-only floor (transform to roi heads, wall per image). Writes
bench/results/ami_stages.json (``--name``).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.common.meters import PeakRss, machine
from bench.common.records import save, stamp
from bench.outcomes import Outcomes, refusing
from worker.commands.demo_images import image_bytes

SLUG = "quebec_vermont_moths_2023"
DETECTOR_PARTS = ("transform", "backbone", "rpn", "roi_heads")
STAGES = (
    "decode",
    "detector transform",
    "backbone",
    "rpn",
    "roi heads",
    "detector rest",
    "crops",
    "filter",
    "classifier",
    "rendering",
    "settle (encode)",
    "other",
)


class Clock:
    """Exclusive wall and CPU seconds per stage: a stage entered inside another is taken out
    of the outer one's time."""

    def __init__(self) -> None:
        self.wall_s = dict.fromkeys(STAGES, 0.0)
        self.cpu_s = dict.fromkeys(STAGES, 0.0)
        self._stack: list[list[Any]] = []
        self.on = False

    def enter(self, name: str) -> None:
        self._stack.append([name, time.perf_counter(), time.process_time(), 0.0, 0.0])

    def leave(self) -> None:
        name, wall0, cpu0, child_wall, child_cpu = self._stack.pop()
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        if self.on:
            self.wall_s[name] += wall - child_wall
            self.cpu_s[name] += cpu - child_cpu
        if self._stack:
            self._stack[-1][3] += wall
            self._stack[-1][4] += cpu

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        self.enter(name)
        try:
            yield
        finally:
            self.leave()

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with self.stage(name):
                return fn(*args, **kwargs)

        return wrapped


def _hooked(clock: Clock, runner: Any) -> None:
    """The clock's stages put around the runner's parts (this process only)."""
    from pipelines import response
    from pipelines import runner as runner_module

    detector = runner.detector.model
    names = dict(zip(DETECTOR_PARTS, STAGES[1:5], strict=True))
    for part, name in names.items():
        module = getattr(detector, part)
        module.register_forward_pre_hook(lambda _m, _a, name=name: clock.enter(name))
        module.register_forward_hook(lambda _m, _a, _o: clock.leave())
    runner.detector.forward = clock.timed("detector rest", runner.detector.forward)
    runner.filter.forward = clock.timed("filter", runner.filter.forward)
    runner.classifier.forward = clock.timed("classifier", runner.classifier.forward)
    runner._classification = clock.timed("rendering", runner._classification)
    response.detection = clock.timed("rendering", response.detection)
    runner_module._cut = clock.timed("crops", runner_module._cut)
    runner_module._squared = clock.timed("crops", runner_module._squared)


def _load(mirror: Path) -> tuple[Any, Any]:
    from config.settings import load_settings
    from datasets.uris import SourceConfig
    from pipelines.runner import load_runner
    from pipelines.setup import choose

    settings = load_settings(
        model={"pipeline": SLUG, "files_mirror": str(mirror), "published_digests": False}
    )
    chosen = choose(settings)
    runner = load_runner(
        chosen.pipeline, SourceConfig(), "cpu", chosen.limits, chosen.response_format
    )
    return chosen, runner


def profile(mirror: Path, jpegs: list[bytes], threads: int) -> dict[str, Any]:
    """The stages' times over ``jpegs`` (after one warm-up image) on ``threads`` threads."""
    import torch

    from datasets.images import decode
    from pipelines.found import fields
    from worker.antenna.render import encoded

    torch.set_num_threads(threads)
    chosen, runner = _load(mirror)
    clock = Clock()
    _hooked(clock, runner)
    outcomes = Outcomes(f"{SLUG} stages")
    boxes = 0
    for n, data in enumerate([jpegs[0], *jpegs]):
        clock.on = n > 0
        with clock.stage("decode"):
            image = decode(data, chosen.plan)
        with clock.stage("other"):
            (detections,) = runner.run([image])
        with clock.stage("settle (encode)"):
            encoded([fields(d, f"image-{n}") for d in detections])
        if n > 0:
            classified = all(len(d.classifications) >= 2 for d in detections)
            if detections and classified:
                outcomes.good()
            else:
                outcomes.bad("not_classified", f"image {n - 1}: {len(detections)} detections")
            boxes += len(detections)
    outcomes.check(len(jpegs))
    return {"threads": threads, "boxes": boxes, "outcomes": outcomes.summary()} | _rates(
        clock, len(jpegs)
    )


def _rates(clock: Clock, images: int) -> dict[str, Any]:
    """Each stage's seconds per image, the whole's, and the detector-only floor."""
    wall = sum(clock.wall_s.values())
    cpu = sum(clock.cpu_s.values())
    floor_s = sum(clock.wall_s[name] for name in STAGES[1:5]) / images
    return {
        "images": images,
        "stages": {
            name: {
                "wall_s_per_image": round(clock.wall_s[name] / images, 3),
                "cpu_s_per_image": round(clock.cpu_s[name] / images, 3),
                "wall_share": round(clock.wall_s[name] / wall, 3),
            }
            for name in STAGES
        },
        "wall_s_per_image": round(wall / images, 3),
        "cpu_s_per_image": round(cpu / images, 3),
        "images_per_s": round(images / wall, 3),
        "detector_floor_wall_s_per_image": round(floor_s, 3),
    }


def _jpegs(images: int, k4_every: int) -> list[bytes]:
    sizes = [(3840, 2160) if n % k4_every == 0 else (1920, 1080) for n in range(images)]
    return [image_bytes(width, height, seed=n) for n, (width, height) in enumerate(sizes)]


def _default_threads() -> int:
    """The threads the worker gives this pipeline here at its defaults."""
    from config.derived import torch_threads
    from config.settings import load_settings
    from worker.engine.cores import available_cores

    return torch_threads(load_settings(), available_cores(), detecting=True)[0]


@refusing
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mirror", type=Path, default=None)
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--k4-every", type=int, default=2)
    parser.add_argument("--threads", type=int, action="append", default=[])
    parser.add_argument("--name", default="ami_stages")
    parser.add_argument("--smoke", action="store_true", help="1 image (the test suite's)")
    args = parser.parse_args(argv)
    from config.settings import load_settings
    from worker.process.allocator import for_process

    allocator = for_process(load_settings(model={"device": "cpu"}))  # as a CPU worker sets it
    print(allocator, flush=True)
    images = 1 if args.smoke else args.images
    jpegs = _jpegs(images, max(1, args.k4_every))
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-ami-stages-") as scratch:
        if args.mirror is None:
            from tests.ami_files import detector_state, write_mirror

            mirror = write_mirror(Path(scratch) / "mirror", (SLUG,), detector_state())
        else:
            mirror = args.mirror
        for threads in args.threads or [_default_threads()]:
            with PeakRss(os.getpid()) as rss:
                run = profile(mirror, jpegs, threads)
            runs.append({**run, "peak_rss_mib": round(rss.peak_bytes / 2**20)})
            print(json.dumps({k: v for k, v in run.items() if k != "stages"}), flush=True)
    payload = {**stamp("ami_stages", argv), "machine": machine(), "pipeline": SLUG, "runs": runs}
    payload["allocator"] = {"kept": allocator.kept, "why": allocator.why}
    save(args.name, payload, echo=False)
    for run in runs:
        print(f"\nthreads={run['threads']}  stage: wall s/img, CPU s/img, share of wall")
        for name, row in run["stages"].items():
            print(
                f"  {name:20s} {row['wall_s_per_image']:7.3f} {row['cpu_s_per_image']:7.3f} "
                f"{100 * row['wall_share']:5.1f}%"
            )


if __name__ == "__main__":
    main()
