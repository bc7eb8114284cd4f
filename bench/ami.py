"""AMI's ``quebec_vermont_moths_2023`` on a job of 1080p and 4K JPEGs through the fake Antenna.

    .venv/bin/python -m bench.ami [--mirror DIR] [--images 60] [--k4-every 4]
                                  [--images-dir DIR] [--set WORKER_X=Y ...] [--smoke]

``--mirror``: AMI's model files (weights and category maps) laid out as under AMI's base URL
(``WORKER_MODEL__FILES_MIRROR``), e.g. the random weights ADC was run with beside it; without
it, random weights in ADC's checkpoint layouts are written to a temporary mirror
(``tests/ami_files.py``: a detector that finds a handful of boxes per image, a filter that
passes them all). Either way the files are not AMI's, so ``WORKER_MODEL__PUBLISHED_DIGESTS``
is off. One job of
``--images`` distinct JPEGs (made: every ``--k4-every``-th 3840x2160, the rest 1920x1080; or
the first of ``--images-dir``'s, by name, the job ADC's worker was run on), served by
the fake Antenna (``tests/antenna_fake.py``); one ``worker run --until-idle`` on the CPU, as an
operator replacing ``ami worker`` would run it. Every task must have exactly one saved result,
with the detector's boxes, each classified, before a rate is reported.

Reported: images/s from the first reservation of tasks answered to the last result saved
(serving, models loaded: what AMI's worker is compared on in BENCHMARKS.md) and over the whole
run (start and model loading included), CPU seconds per image of the worker and its loader
children (their rusage once reaped), and the peak of the tree's summed resident memory
(shared pages counted in each process). Writes bench/results/ami.json.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common.meters import PeakRss, machine, tree
from bench.common.records import save, stamp
from bench.outcomes import BenchmarkFailed, Outcomes, refusing
from tests.antenna_fake import FakeAntenna, endpoint_of
from worker.commands.demo_images import image_bytes

SLUG = "quebec_vermont_moths_2023"
TOKEN = "bench-ami-token-5c1e"
RUN_TIMEOUT_S = 3600


def _environment(antenna: FakeAntenna, mirror: Path, cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WORKER_", "AMI_"))}
    env.update(
        {
            "WORKER_SOURCE": "antenna",
            "WORKER_ANTENNA__BASE_URL": antenna.url,
            "WORKER_ANTENNA__TOKEN": TOKEN,
            "WORKER_ANTENNA__PROJECT_IDS": "1",
            "WORKER_ANTENNA__POLL_INTERVAL_S": "1",
            "WORKER_SOURCES__ALLOWED_HOSTS": "127.0.0.1",
            "WORKER_MODEL__PIPELINES": SLUG,
            "WORKER_MODEL__FILES_MIRROR": str(mirror),
            "WORKER_MODEL__PUBLISHED_DIGESTS": "false",
            "WORKER_MODEL__CACHE_DIR": str(cache),
            "WORKER_MODEL__DEVICE": "cpu",
            "WORKER_METRICS__PORT": "0",
            "WORKER_LOG_LEVEL": "WARNING",
        }
    )
    return env


def _checked(job: Any, tasks: list[str]) -> Outcomes:
    """Each task saved, with boxes, each box classified; one result saved per task."""
    outcomes = Outcomes(f"{SLUG} job")
    for task in tasks:
        detections = job.saved.get(task, [])
        if task in job.failed or task not in job.done:
            outcomes.bad("not_saved", f"{task}: failed or not saved")
        elif not detections or not all(d.get("classifications") for d in detections):
            outcomes.bad("not_classified", f"{task}: {len(detections)} detections")
        else:
            outcomes.good()
    if len(job.result_times) != len(tasks):
        outcomes.bad("saved_twice", f"{len(job.result_times)} results for {len(tasks)} tasks")
    outcomes.check(len(tasks))
    return outcomes


def _reserved(method: str, path: str, status: int) -> bool:
    return endpoint_of(method, path) == "tasks" and status == 200


def _first_reservation(antenna: FakeAntenna, stop: threading.Event) -> list[float]:
    """Starts a thread that notes when the first reservation of tasks was answered."""
    seen: list[float] = []

    def watch() -> None:
        while not stop.is_set() and not seen:
            if any(_reserved(*request) for request in list(antenna.requests)):
                seen.append(time.monotonic())
            stop.wait(0.05)

    threading.Thread(target=watch, daemon=True).start()
    return seen


def _run(env: dict[str, str], processes: int) -> tuple[float, float, int]:
    """``processes`` x ``worker run --until-idle`` on the one job, as supervisord's
    ``numprocs`` would run them (``WORKER_PROCESS_INDEX`` 0..n-1): (wall seconds, CPU seconds
    of them and their reaped children, peak summed RSS of their process trees in bytes)."""
    started = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "worker", "run", "--until-idle"],
            env={**env, "WORKER_PROCESS_INDEX": str(index)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for index in range(processes)
    ]
    trees = [tree(run.pid) for run in runs]
    with PeakRss(pids=lambda: [pid for pids in trees for pid in pids()]) as rss:
        errors = [_ended(run) for run in runs]
    for run, err in zip(runs, errors, strict=True):
        if run.returncode != 0:
            raise BenchmarkFailed(f"worker run exited {run.returncode}: {err[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = sum(getattr(after, f) - getattr(before, f) for f in ("ru_utime", "ru_stime"))
    return time.perf_counter() - started, cpu_s, rss.peak_bytes


def _ended(run: subprocess.Popen[str]) -> str:
    """``run``'s stderr once it has ended; killed past ``RUN_TIMEOUT_S``."""
    try:
        return run.communicate(timeout=RUN_TIMEOUT_S)[1]
    except subprocess.TimeoutExpired:
        run.kill()
        run.communicate()
        raise BenchmarkFailed(f"worker run did not end within {RUN_TIMEOUT_S} s") from None


def _jpegs(images: int, k4_every: int, given: Path | None) -> list[bytes]:
    """``given``'s JPEGs (sorted by name, the first ``images``), or made ones."""
    if given is not None:
        found = [path.read_bytes() for path in sorted(given.glob("*.jp*g"))][:images]
        if len(found) < images:
            raise BenchmarkFailed(f"{given} holds {len(found)} JPEGs, {images} asked for")
        return found
    sizes = [(3840, 2160) if n % k4_every == 0 else (1920, 1080) for n in range(images)]
    return [image_bytes(width, height, seed=n) for n, (width, height) in enumerate(sizes)]


def run_job(
    mirror: Path, jpegs: list[bytes], cache: Path, settings: dict[str, str], processes: int = 1
) -> dict[str, Any]:
    antenna = FakeAntenna(token=TOKEN)
    images = len(jpegs)
    for n, data in enumerate(jpegs):
        antenna.images[f"{n}.jpg"] = data
    with antenna.running():
        env = {**_environment(antenna, mirror, cache), **settings}
        done = subprocess.run(
            [sys.executable, "-m", "worker", "register"], env=env, capture_output=True,
            text=True, timeout=600,
        )  # fmt: skip
        if done.returncode != 0:
            raise BenchmarkFailed(f"register failed: {done.stdout[-1000:]}{done.stderr[-1000:]}")
        tasks = [f"t{n}" for n in range(images)]
        job_id = antenna.add_job(
            SLUG, [(t, antenna.media_url(f"{n}.jpg")) for n, t in enumerate(tasks)]
        )
        stop = threading.Event()
        first = _first_reservation(antenna, stop)
        wall_s, cpu_s, peak_bytes = _run(env, processes)
        stop.set()
        job = antenna.jobs[job_id]
        outcomes = _checked(job, tasks)
    if not first:
        raise BenchmarkFailed("no reservation of tasks was answered")
    span_s = max(job.result_times) - first[0]
    return {
        "images": images,
        "processes": processes,
        "jpeg_mib": round(sum(len(data) for data in jpegs) / 2**20, 1),
        "outcomes": outcomes.summary(),
        "serving_images_per_s": round(images / span_s, 3),
        "whole_run_images_per_s": round(images / wall_s, 3),
        "whole_run_s": round(wall_s, 1),
        "cpu_s_per_image": round(cpu_s / images, 3),
        "peak_rss_mib": round(peak_bytes / 2**20),
    }


def _random_mirror(root: Path) -> Path:
    from tests.ami_files import detector_state, write_mirror

    return write_mirror(root / "mirror", (SLUG,), detector_state())


@refusing
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mirror", type=Path, default=None)
    parser.add_argument("--images", type=int, default=60)
    parser.add_argument("--k4-every", type=int, default=4)
    parser.add_argument("--images-dir", type=Path, default=None, help="JPEGs to serve instead")
    parser.add_argument(
        "--set", action="append", default=[], metavar="WORKER_X=Y", help="a setting for the run"
    )
    parser.add_argument("--processes", type=int, default=1, help="workers on the job (numprocs)")
    parser.add_argument("--name", default="ami", help="results file name (bench/results/NAME.json)")
    parser.add_argument("--smoke", action="store_true", help="2 images (the test suite's)")
    args = parser.parse_args(argv)
    images = 2 if args.smoke else args.images
    with tempfile.TemporaryDirectory(prefix="bench-ami-") as scratch:
        mirror = args.mirror or _random_mirror(Path(scratch))
        jpegs = _jpegs(images, max(1, args.k4_every), args.images_dir)
        settings = dict(item.split("=", 1) for item in args.set)
        result = run_job(mirror, jpegs, Path(scratch) / "cache", settings, max(1, args.processes))
    weights = str(args.mirror) if args.mirror else "random (tests/ami_files.py)"
    payload = {**stamp("ami", argv), "machine": machine(), "pipeline": SLUG, "weights": weights}
    payload["settings"] = dict(item.split("=", 1) for item in args.set)
    save(args.name, {**payload, **result}, echo=True)


if __name__ == "__main__":
    main()
