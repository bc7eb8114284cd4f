"""The world a benchmark runs in: local NATS and S3 servers, a model, uploaded images, and
``inference-worker run`` processes against them."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker.commands.demo_images import image_bytes
from worker.commands.localservers import NatsServer, S3Server, stop_process

if TYPE_CHECKING:
    from config.settings import NatsSettings

PIPELINE = "mobilenet-v3-small-classifier"
ARCHITECTURE = "mobilenet_v3_small"


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


def nats_settings(w: World) -> NatsSettings:
    """The NATS settings of a client of ``w``'s server (the worker's defaults otherwise)."""
    from config.settings import load_settings

    return load_settings(for_worker=False, nats={"url": w.nats.url}).nats


def upload(s3: Any, bucket: str, sizes: list[tuple[int, int]], count: int) -> list[str]:
    s3.create_bucket(Bucket=bucket)
    uris = []
    for i in range(count):
        width, height = sizes[i % len(sizes)]
        key = f"img/{i:05d}-{width}x{height}.jpg"
        s3.put_object(Bucket=bucket, Key=key, Body=image_bytes(width, height, seed=i, quality=90))
        uris.append(f"s3://{bucket}/{key}")
    return uris


def cycle(uris: list[str], count: int) -> list[str]:
    """``count`` task URIs cycling over ``uris``."""
    return [uris[i % len(uris)] for i in range(count)]


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
