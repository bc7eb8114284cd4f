"""S3 at its real latency: the loader and the worker behind a shaped network.

    .venv/bin/python -m bench.network [--images 24] [--tasks 96] [--runs 3]

Objects: 4096x2160 JPEGs of about 24 MB and 1920x1080 ones of 1-3 MB (noisy scenes, so they
are that large), in a local S3 endpoint (moto), read directly ("unshaped") or through
``testing.shapednet`` with S3's figures (first byte median 30 ms, p99 300 ms, 90 MB/s per
connection). Each job has ``--tasks`` tasks cycling over the images (the loader keeps no
cache: a repeated image costs what a new one does), long enough that filling and draining the
pipeline (a first byte and one object's transfer, ~0.3-0.6 s) does not dominate. For each set:

- the loader alone (two children, the classifier's default preprocessing to 224 px):
  unshaped with 8 reads per child; shaped with 8 reads per child; shaped with one read at a
  time (the code before reads overlapped); shaped with AMI's pattern (a persistent DataLoader
  whose two workers each fetch 8 presigned URLs at once with 8 ``requests`` threads, wait for
  all 8, then decode them);
- the worker end to end (classifier, batch 16, two loader children), unshaped and shaped.

Reported: images/s (median of ``--runs``), the most requests in flight at the network, the
children's peak encoded bytes held for reads, their peak resident memory. Also the CPU cost
of decoding one 24 MB 4K JPEG three ways. Writes bench/results/network.json.
"""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from bench.common.bench_args import run_benchmark
from bench.common.meters import PeakRss, machine, median
from bench.common.world import PIPELINE, World, cycle, start_worker, stop_worker, world
from bench.outcomes import Outcomes, refusing
from datasets.images import DecodePlan, resize_square
from testing.shapednet import UNSHAPED, Shape, ShapedProxy
from worker.commands.demo_images import image_bytes

CHILDREN = 2
AMI_THREADS = 8
SETS = {"4k": (4096, 2160, 99, 28.0), "1080p": (1920, 1080, 95, 18.0)}


def noisy_jpeg(width: int, height: int, quality: int, sigma: float, seed: int) -> bytes:
    """A scene with sensor-like noise, so the JPEG is as large as a camera trap's."""
    rng = np.random.default_rng(seed)
    base = Image.open(io.BytesIO(image_bytes(width, height, seed=seed))).convert("RGB")
    pixels = np.asarray(base, dtype=np.int16)
    pixels = pixels + rng.normal(0, sigma * rng.uniform(0.6, 1.0), pixels.shape).astype(np.int16)
    out = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(
        out, format="JPEG", quality=quality, subsampling=0
    )
    return out.getvalue()


def upload(w: World, name: str, count: int) -> tuple[list[str], list[int]]:
    width, height, quality, sigma = SETS[name]
    s3 = w.s3.client()
    bucket = f"net-{name}"
    s3.create_bucket(Bucket=bucket)
    uris, sizes = [], []
    for i in range(count):
        data = noisy_jpeg(width, height, quality, sigma, seed=i)
        key = f"{i:04d}.jpg"
        s3.put_object(Bucket=bucket, Key=key, Body=data)
        uris.append(f"s3://{bucket}/{key}")
        sizes.append(len(data))
    return uris, sizes


def loader_case(endpoint: str, uris: list[str], reads: int, runs: int) -> dict[str, Any]:
    from datasets.loader import LoaderConfig, LoadRequest, StreamingLoader
    from datasets.uris import SourceConfig

    sources = SourceConfig(
        s3_endpoint_url=endpoint, reads_in_flight=reads, read_timeout_s=5.0, max_attempts=3
    )
    loader = StreamingLoader(
        LoaderConfig(
            num_workers=CHILDREN,
            timeout_s=120.0,
            plan=DecodePlan(size=224),
            sources=sources,
            prefetch_per_worker=len(uris),
        )
    )
    loader.start()
    rates, peak_read_bytes, retries = [], 0, 0
    try:
        with PeakRss(pids=loader.child_pids) as memory:
            for run in range(runs + 1):  # the first run warms up
                outcomes = Outcomes(f"loader, {reads} reads per child, run {run}")
                started = time.perf_counter()
                loader.submit([LoadRequest(run * 10_000 + i, u) for i, u in enumerate(uris)])
                for _ in uris:
                    loaded = loader.next_loaded()
                    if loaded.failure is not None:
                        outcomes.bad(loaded.failure.kind, loaded.failure.message)
                    else:
                        outcomes.good()
                    retries += len(loaded.retries)
                    if loaded.reads is not None:
                        peak_read_bytes = max(peak_read_bytes, loaded.reads.peak_bytes)
                elapsed = time.perf_counter() - started
                outcomes.check(len(uris))
                if run:
                    rates.append(len(uris) / elapsed)
    finally:
        loader.close()
    return {
        "images_per_s": median(rates),
        "runs_images_per_s": rates,
        "failures": 0,
        "retries": retries,
        "peak_read_bytes_one_child": peak_read_bytes,
        "children_peak_rss_bytes": memory.peak_bytes,
    }


class AmiBatches(IterableDataset[np.ndarray]):
    """AMI's pattern: each DataLoader worker takes its share of the URLs 8 at a time, fetches
    the 8 at once with 8 ``requests`` threads, waits for all of them, then decodes each."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls

    def __iter__(self) -> Iterator[np.ndarray]:
        import requests

        info = get_worker_info()
        mine = self.urls[info.id :: info.num_workers] if info else self.urls
        local = threading.local()

        def fetch(url: str) -> bytes:
            session = getattr(local, "session", None)
            if session is None:
                session = local.session = requests.Session()
            response = session.get(url, timeout=30)
            response.raise_for_status()
            return bytes(response.content)

        with ThreadPoolExecutor(AMI_THREADS) as pool:
            for start in range(0, len(mine), AMI_THREADS):
                for data in list(pool.map(fetch, mine[start : start + AMI_THREADS])):
                    image = Image.open(io.BytesIO(data)).convert("RGB")
                    chw = torch.from_numpy(np.asarray(image).transpose(2, 0, 1).copy())
                    yield resize_square(chw, 224, "squash").numpy()


def _as_is(item: Any) -> Any:
    return item


def _one_thread(_worker_id: int) -> None:
    torch.set_num_threads(1)


def ami_case(endpoint: str, uris: list[str], runs: int) -> dict[str, Any]:
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    urls = []
    for uri in uris:
        bucket, _, key = uri.removeprefix("s3://").partition("/")
        urls.append(
            s3.generate_presigned_url(
                "get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=3600
            )
        )
    loader = DataLoader(
        AmiBatches(urls),
        batch_size=None,
        num_workers=CHILDREN,
        multiprocessing_context="forkserver",
        persistent_workers=True,
        collate_fn=_as_is,
        worker_init_fn=_one_thread,
        timeout=120,
    )
    rates = []
    for run in range(runs + 1):  # the first run warms up (and starts the workers)
        started = time.perf_counter()
        outcomes = Outcomes(f"AMI's pattern, run {run}")
        for square in loader:
            if square.shape == (3, 224, 224):
                outcomes.good()
            else:
                outcomes.bad("wrong_shape", f"image {square.shape}, (3, 224, 224) expected")
        elapsed = time.perf_counter() - started
        outcomes.check(len(uris))
        if run:
            rates.append(len(uris) / elapsed)
    del loader
    return {"images_per_s": median(rates), "runs_images_per_s": rates}


async def worker_case(w: World, endpoint: str, uris: list[str], runs: int) -> dict[str, Any]:
    from bench.common.job_runs import client, run_job
    from bench.common.world import nats_settings

    settings = nats_settings(w)
    rates = []
    async with client(settings, PIPELINE) as nc:
        proc = start_worker(
            w,
            "network-worker.log",
            WORKER_S3__ENDPOINT_URL=endpoint,
            WORKER_LOADER__BATCH_SIZE="16",
            WORKER_LOADER__NUM_WORKERS=str(CHILDREN),
            WORKER_LOADER__TIMEOUT_S="120",
            WORKER_HEALTH__STALL_TIMEOUT_S="200",
            WORKER_HEALTH__WATCHDOG_TIMEOUT_S="250",
        )
        try:
            with PeakRss(proc.pid) as peak:
                for run in range(runs + 1):
                    seconds = await run_job(nc, settings, f"net-{time.time_ns()}", uris)
                    if run:
                        rates.append(len(uris) / seconds)
        finally:
            stop_worker(proc)
    return {
        "images_per_s": median(rates),
        "runs_images_per_s": rates,
        "peak_rss_bytes": peak.peak_bytes,
    }


def decode_costs(data: list[bytes]) -> dict[str, float]:
    """CPU ms per image on one thread: reduced-scale decode (today's fast path, to 224 px),
    full decode with PIL, full decode with torchvision.io.decode_jpeg; and how far the two
    full decodes differ."""
    from torchvision.io import decode_jpeg

    torch.set_num_threads(1)
    out: dict[str, float] = {}

    def timed(name: str, fn: Callable[[bytes], Any]) -> list[Any]:
        fn(data[0])
        started = time.process_time()
        made = [fn(d) for d in data]
        out[f"{name}_cpu_ms"] = 1000 * (time.process_time() - started) / len(data)
        return made

    def reduced(d: bytes) -> Any:
        image = Image.open(io.BytesIO(d))
        image.draft("RGB", (224, 224))
        return np.asarray(image.convert("RGB"))

    timed("pil_reduced_scale", reduced)
    pil = timed("pil_full", lambda d: np.asarray(Image.open(io.BytesIO(d)).convert("RGB")))
    tv = timed(
        "torchvision_decode_jpeg", lambda d: decode_jpeg(torch.frombuffer(d, dtype=torch.uint8))
    )
    diffs = [
        int(np.abs(a.astype(np.int16) - b.permute(1, 2, 0).numpy().astype(np.int16)).max())
        for a, b in zip(pil[:4], tv[:4], strict=True)
    ]
    out["full_decodes_max_abs_difference"] = float(max(diffs))
    return out


async def run(images: int, tasks: int, runs: int, smoke: bool = False) -> dict[str, Any]:
    result: dict[str, Any] = {
        "machine": machine(),
        "images": images,
        "tasks_per_job": tasks,
        "runs": runs,
        "sets": {},
    }
    with world() as w:
        for name in ["1080p"] if smoke else SETS:
            distinct, sizes = upload(w, name, images)
            print(f"{name}: {tasks} objects, {sum(sizes) / len(sizes) / 1e6:.1f} MB mean")
            cases: dict[str, Any] = {"mean_object_bytes": sum(sizes) / len(sizes)}
            cases.update(await one_set(w, cycle(distinct, tasks), runs, smoke))
            if name == "4k":
                s3 = w.s3.client()
                blobs = [
                    s3.get_object(Bucket=u.split("/")[2], Key=u.split("/", 3)[3])["Body"].read()
                    for u in distinct[:8]
                ]
                cases["decode"] = decode_costs(blobs)
                print(f"  decode: {json.dumps(cases['decode'])}")
            result["sets"][name] = cases
    return result


async def one_set(w: World, uris: list[str], runs: int, smoke: bool) -> dict[str, Any]:
    """Every case on one set of images: the loader and AMI's pattern direct, through the relay
    alone and shaped, then the worker direct and shaped; and the ratios."""
    cases: dict[str, Any] = {}
    direct = w.s3.endpoint_url
    shaped = ShapedProxy(w.s3.port, Shape())
    relay = ShapedProxy(w.s3.port, UNSHAPED)
    with shaped, relay:
        plan: list[tuple[str, str, int, ShapedProxy | None]] = [
            ("loader_unshaped_8_reads", direct, 8, None),
            ("loader_relay_only_8_reads", relay.url, 8, relay),
            ("loader_shaped_8_reads", shaped.url, 8, shaped),
            ("loader_shaped_1_read", shaped.url, 1, shaped),
            ("ami_shaped_8_threads", shaped.url, 0, shaped),
        ]
        if smoke:  # one loader case each way, AMI's, and one worker
            plan = [plan[0], plan[2], plan[4]]
        for case, endpoint, reads, proxy in plan:
            cases[case] = (
                loader_case(endpoint, uris, reads, runs)
                if reads
                else ami_case(endpoint, uris, runs)
            )
            if proxy is not None:
                stats = proxy.stats()
                cases[case]["network_max_in_flight"] = stats["max_in_flight"]
                cases[case]["network_requests"] = stats["requests"]
                proxy.stop()
                proxy.start()  # fresh counters for the next case
            print(f"  {case}: {cases[case]['images_per_s']:.2f} images/s")
        workers = [("worker_unshaped", direct), ("worker_shaped", shaped.url)]
        for case, endpoint in workers[1:] if smoke else workers:
            cases[case] = await worker_case(w, endpoint, uris, runs)
            print(f"  {case}: {cases[case]['images_per_s']:.2f} images/s")
    rate = {case: cases[case]["images_per_s"] for case in cases}
    cases["shaped_to_unshaped_loader"] = (
        rate["loader_shaped_8_reads"] / rate["loader_unshaped_8_reads"]
    )
    if not smoke:
        cases["shaped_to_unshaped_worker"] = rate["worker_shaped"] / rate["worker_unshaped"]
    return cases


@refusing
def main() -> None:
    run_benchmark("network", run)


if __name__ == "__main__":
    main()
