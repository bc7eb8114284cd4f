"""Shared pieces of the benchmarks: local servers, a model, images, a worker process, sampling."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from bench.outcomes import BenchmarkFailed, Outcomes
from worker.commands.demo_images import image_bytes
from worker.commands.localservers import NatsServer, S3Server, stop_process

if TYPE_CHECKING:
    from datasets.images import Decoded
    from datasets.loader import StreamingLoader

PIPELINE = "mobilenet-v3-small-classifier"
ARCHITECTURE = "mobilenet_v3_small"
RESULTS = Path(__file__).parent / "results"
# A smoke run (the test suite's) writes its results here instead, never over the real ones.
RESULTS_ENV = "BENCH_RESULTS_DIR"


@dataclass
class World:
    nats: NatsServer
    s3: S3Server
    weights: str
    workdir: Path


@contextmanager
def world() -> Iterator[World]:
    from pipelines.models import save_classifier

    workdir = Path(tempfile.mkdtemp(prefix="iw-bench-"))
    nats = NatsServer(store_dir=str(workdir / "nats")).start()
    s3 = S3Server().start()
    os.environ.update(s3.credentials_env())
    weights = save_classifier(ARCHITECTURE, [f"c{i}" for i in range(10)], str(workdir / "model"))
    try:
        yield World(nats, s3, weights, workdir)
    finally:
        s3.stop()
        nats.stop()


def upload(s3: Any, bucket: str, sizes: list[tuple[int, int]], count: int) -> list[str]:
    s3.create_bucket(Bucket=bucket)
    uris = []
    for i in range(count):
        width, height = sizes[i % len(sizes)]
        key = f"img/{i:05d}-{width}x{height}.jpg"
        s3.put_object(Bucket=bucket, Key=key, Body=image_bytes(width, height, seed=i, quality=90))
        uris.append(f"s3://{bucket}/{key}")
    return uris


def worker_env(w: World, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    env.update(
        {
            "WORKER_NATS__URL": w.nats.url,
            "WORKER_S3__ENDPOINT_URL": w.s3.endpoint_url,
            "WORKER_MODEL__PIPELINE": PIPELINE,
            "WORKER_MODEL__WEIGHTS": w.weights,
            "WORKER_MODEL__DEVICE": "cpu",
            "WORKER_METRICS__PORT": "0",
            "WORKER_LOG_LEVEL": os.environ.get("BENCH_LOG_LEVEL", "WARNING"),
        }
    )
    env.update(extra)
    return env


def start_worker(w: World, log_name: str, **extra: str) -> subprocess.Popen[bytes]:
    log = open(w.workdir / log_name, "ab")  # noqa: SIM115 - lives as long as the process
    return subprocess.Popen(
        [sys.executable, "-m", "worker", "run"],
        env=worker_env(w, **extra),
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def stop_worker(proc: subprocess.Popen[bytes]) -> int:
    return stop_process(proc, wait_s=60.0)


async def results_stored(js: Any, stream: str) -> int:
    info = await js.stream_info(stream)
    return int(info.state.messages)


async def wait_stored(js: Any, stream: str, count: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while await results_stored(js, stream) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {count} results after {timeout_s}s")
        await asyncio.sleep(0.05)


def _tree(pid: int) -> list[int]:
    try:
        root = psutil.Process(pid)
        return [pid, *(child.pid for child in root.children(recursive=True))]
    except psutil.Error:
        return []


class PeakRss:
    """Samples the summed resident memory of a process tree (or of the processes ``pids()``
    names) every 50 ms; ``peak_bytes`` when done."""

    def __init__(self, pid: int = 0, pids: Callable[[], list[int]] | None = None) -> None:
        self._pids = pids or (lambda: _tree(pid))
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0
            for pid in self._pids():
                try:
                    total += psutil.Process(pid).memory_info().rss
                except psutil.Error:
                    pass
            self.peak_bytes = max(self.peak_bytes, total)
            self._stop.wait(0.05)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


def machine() -> dict[str, Any]:
    import torch

    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def cycle(uris: list[str], count: int) -> list[str]:
    """``count`` task URIs cycling over ``uris``."""
    return [uris[i % len(uris)] for i in range(count)]


class TreeCpu:
    """Process CPU seconds (user + system) of the processes ``pids()`` names, summed over
    ``with`` blocks: what those processes spent, whatever else the machine ran."""

    def __init__(self, pids: Callable[[], list[int]]) -> None:
        self._pids = pids
        self.cpu_s = 0.0

    def _read(self) -> dict[int, float]:
        times = {}
        for pid in self._pids():
            try:
                t = psutil.Process(pid).cpu_times()
            except psutil.Error:
                continue
            times[pid] = float(t.user + t.system)
        return times

    def __enter__(self) -> TreeCpu:
        self._start = self._read()
        return self

    def __exit__(self, *_exc: object) -> None:
        end = self._read()
        self.cpu_s += sum(cpu - self._start.get(pid, 0.0) for pid, cpu in end.items())

    def ms_per_image(self, images: int) -> float:
        return round(1000 * self.cpu_s / max(1, images), 2)


def tree(pid: int) -> Callable[[], list[int]]:
    """The pids of ``pid`` and its descendants, as they are when called."""
    return lambda: _tree(pid)


class CpuMeter:
    """Machine-wide busy CPU seconds over a ``with`` block (all processes, every core)."""

    busy_s = 0.0
    wall_s = 0.0

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()
        return float(t.user + t.nice + t.system + getattr(t, "irq", 0) + getattr(t, "softirq", 0))

    def __enter__(self) -> CpuMeter:
        self._busy0, self._wall0 = self._busy(), time.perf_counter()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.busy_s += self._busy() - self._busy0
        self.wall_s += time.perf_counter() - self._wall0

    def summary(self, images: int) -> dict[str, float]:
        cores = os.cpu_count() or 1
        return {
            "cpu_busy_fraction": self.busy_s / (self.wall_s * cores),
            "cpu_ms_per_image": 1000 * self.busy_s / images,
        }


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def results_dir() -> Path:
    return Path(os.environ.get(RESULTS_ENV) or RESULTS)


def save(name: str, payload: dict[str, Any]) -> Path:
    results = results_dir()
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


SMOKE = {"images": 4, "tasks": 8, "runs": 1}


def run_benchmark(name: str, run: Any) -> tuple[dict[str, Any], Path, bool]:
    """``--images N --tasks T --runs R``: run ``run(images, tasks, runs)``, save, print.

    ``images`` distinct images are generated and uploaded; each job has ``tasks`` tasks that
    cycle over them (the loader keeps no cache, so a repeated image costs what a new one does).
    Jobs much longer than a batch keep the pipeline's fill and drain out of the rate.
    ``--smoke``: 4 images, 8-task jobs, one run (the test suite's check that it still works;
    its rates mean nothing). Every stage checks its outcomes first (``bench.outcomes``).
    """
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=48)
    parser.add_argument("--tasks", type=int, default=192)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny and quick: outcomes only")
    args = parser.parse_args()
    if args.smoke:
        args.images, args.tasks, args.runs = SMOKE["images"], SMOKE["tasks"], SMOKE["runs"]
    result = asyncio.run(run(args.images, args.tasks, args.runs, args.smoke))
    result["command"] = " ".join(["python -m", f"bench.{name}", *sys.argv[1:]])
    result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    path = save(name, result)
    print(json.dumps(result, indent=2))
    return result, path, args.smoke


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


def last_json_line(args: list[str], what: str, timeout_s: float) -> tuple[dict[str, Any], int]:
    """Run ``args`` (a pattern compared against, in a process of its own): the JSON of the
    last line it printed, and its peak resident bytes; ``BenchmarkFailed`` with the end of its
    stderr unless it exited 0 having printed one."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with PeakRss(proc.pid) as peak:
        out, err = proc.communicate(timeout=timeout_s)
    lines = out.decode().strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = " | ".join(err.decode(errors="replace").strip().splitlines()[-3:])
        raise BenchmarkFailed(f"{what} exited {proc.returncode}: {tail}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result, peak.peak_bytes
