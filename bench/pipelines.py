"""Several pipelines and jobs in one process (docs/pipelines.md, "Several pipelines in one process",
"Fair share across jobs"). Four cases, each checking its own outcomes before it reports:

    .venv/bin/python -m bench.pipelines [--cases switch,interleaved,fairness,memory] [--smoke]

- ``switch``: what a model switch costs, in the benchmark's process through the worker's own
  ``ModelCache`` and ``load_runner``: a cache hit, a load from disk, a load from S3 (the local
  S3 endpoint); medians. The loaded models must give the disk original's sha256 and logits.
- ``interleaved``: images/s of two pipelines' jobs run together in one worker, against each
  alone (from publish to the last result, and steady: first result to last); then together
  under a memory budget that holds only one of the two models.
- ``fairness``: a 5-task job published right after a 240-task job, with fair share off
  (``WORKER_NATS__FAIR_JOBS=false``, stream order), on, and on with a shorter
  ``WORKER_NATS__JOB_DISCOVERY_S``: when the small job's last result arrives as a share of
  the big job's time, the longest time each job went without a result while both were
  pending, and the latency of one-image jobs published one after the other.
- ``memory``: 10 classifier pipelines (each its own weights) served in turn, twice, under a
  budget that fits 3 and under one that fits all 10: models resident, their bytes, loads and
  evictions (the worker's /metrics), the worker's resident memory (psutil); every task's
  answer must be the same under both budgets.

Every result of every job is checked: exactly one stored result per task, ``ok``, from the
job's own pipeline and its model (``model.name``, ``model.weights_sha256`` of that
pipeline's weights file, its own labels). One failure and the benchmark exits 1 without a
figure (``bench.outcomes``). Writes bench/results/pipelines.json.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bench.common.job_runs import Job, client, run_jobs
from bench.common.meters import PeakRss, machine, median
from bench.common.records import save, stamp
from bench.common.world import World, cycle, start_worker, stop_worker, upload, world
from bench.outcomes import BenchmarkFailed, Outcomes, refusing
from config.names import env_name
from config.settings import NatsSettings, load_settings
from worker.commands.job_client import job_results, make_tasks
from worker.commands.localservers import free_port
from worker.health.metrics import PREFIX

ARCH = "resnet18"  # switch and memory: 44.7 MB of weights each
FAST_ARCH = "mobilenet_v3_small"  # interleaved and fairness: the loader is the limit
JOB_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Sizes:
    images: int = 48
    image_sizes: tuple[tuple[int, int], ...] = ((1920, 1080), (4096, 2160))
    loader_workers: int = 2
    switch_loads: int = 5  # loads from disk and from S3, each, after one of each to warm up
    switch_hits: int = 1000
    interleaved_tasks: int = 192
    interleaved_rounds: int = 3
    big: int = 240
    small: int = 5
    fair_runs: int = 3
    one_image_jobs: int = 10  # one-task jobs one after the other: a new job's latency
    fast_discovery_s: float = 0.1  # fairness's third mode (0: not run)
    memory_pipelines: int = 10
    memory_fits: int = 3
    memory_tasks: int = 8
    memory_passes: int = 2
    memory_arch: str = ARCH
    discovery_s: float = 0.0  # every worker's WORKER_NATS__JOB_DISCOVERY_S; 0: the default


SMOKE = Sizes(
    images=4,
    image_sizes=((320, 240),),
    loader_workers=1,
    switch_loads=1,
    switch_hits=10,
    interleaved_tasks=4,
    interleaved_rounds=1,
    big=12,
    small=2,
    fair_runs=1,
    one_image_jobs=2,
    fast_discovery_s=0.0,
    memory_pipelines=3,
    memory_fits=2,
    memory_tasks=2,
    memory_passes=2,
    memory_arch=FAST_ARCH,
    discovery_s=0.1,  # a smoke run's jobs wait less for discovery
)


@dataclass(frozen=True)
class Declared:
    """A pipeline declared in TOML for the benchmark: its own weights and labels."""

    name: str
    toml: str
    weights: Path
    sha256: str


def declare(directory: Path, name: str, seed: int, arch: str) -> Declared:
    from pipelines.models import save_classifier

    labels = [f"{name}-{i}" for i in range(10)]
    weights = Path(save_classifier(arch, labels, str(directory / name), seed=seed))
    toml = directory / f"{name}.toml"
    toml.write_text(
        f'name = "{name}"\n[classifier]\nkey = "{name}"\narchitecture = "{arch}"\n'
        f'weights = "{weights}"\n'
    )
    return Declared(name, str(toml), weights, hashlib.sha256(weights.read_bytes()).hexdigest())


def loaded_bytes(declared: Declared) -> int:
    """What the worker's memory budget counts for this pipeline (loaded here once)."""
    from datasets.uris import SourceConfig
    from pipelines.registry import resolve
    from pipelines.runner import load_runner

    return load_runner(resolve(declared.toml), SourceConfig(), "cpu").weights_bytes()


# -- jobs through a worker, every result checked ---------------------------------------------
def answer_problem(result: dict[str, Any], expected: Declared) -> tuple[str, str] | None:
    """(kind, detail) when a stored result is not an ``ok`` answer of ``expected``'s model."""
    if result.get("status") != "ok":
        error = result.get("error") or {}
        return str(error.get("type", "not_ok")), str(error.get("message", result))[:300]
    model = result.get("model") or {}
    if result.get("pipeline") != expected.name or model.get("name") != expected.name:
        return "wrong_pipeline", f"{result.get('pipeline')}/{model.get('name')}, not {expected}"
    if model.get("weights_sha256") != expected.sha256:
        return "wrong_weights", f"weights {model.get('weights_sha256')} for {expected.name}"
    label = classification(result)[0]
    if not label.startswith(f"{expected.name}-"):
        return "wrong_labels", f"label {label!r} in a result of {expected.name}"
    return None


def classification(result: dict[str, Any]) -> tuple[str, list[float]]:
    """The label and scores of a classifier pipeline's result."""
    entry = result["response"]["detections"][0]["classifications"][0]
    return str(entry["classification"]), list(entry["scores"])


def check_job(job: Job, pipeline: Declared) -> None:
    """BenchmarkFailed unless every task of ``job`` has exactly one stored result, each an
    ``ok`` answer of the job's own ``pipeline``."""
    outcomes = Outcomes(f"job {job.name} ({pipeline.name})")
    expected = {t.id for t in make_tasks(job.name, job.uris)}
    seen: Counter[str] = Counter()
    for result in job.results:
        task = str(result.get("task_id"))
        seen[task] += 1
        problem = answer_problem(result, pipeline)
        if task not in expected:
            outcomes.bad("unknown_task", f"a result for task {task!r}")
        elif seen[task] > 1:
            outcomes.bad("duplicate", f"a second stored result for task {task!r}")
        elif problem is not None:
            outcomes.bad(*problem)
        else:
            outcomes.good()
    outcomes.check(len(expected))
    if job.messages != len(job.uris):
        raise BenchmarkFailed(f"{job.name}: {job.messages} result messages for {len(job.uris)}")


@dataclass
class Serving:
    """One running worker, a NATS client, and its /metrics port."""

    w: World
    nc: Any
    settings: NatsSettings
    proc: Any
    metrics_port: int
    log: Path
    declared: dict[str, Declared]  # the pipelines served, by name
    published: set[str] = field(default_factory=set)

    async def run(self, jobs: list[Job]) -> list[Job]:
        """Publish ``jobs`` one after the other (list order), wait for every task's result
        (arrival times from a subscription), then read and check the stored results.

        Each job's name gets this worker's consumer name in front: a job published again
        under a name already used would be dropped by the stream's dedupe, never answered."""
        for job in jobs:
            job.name = f"{self.settings.consumer}-{job.name}"
            if job.name in self.published:
                raise BenchmarkFailed(f"job {job.name} published twice")
            self.published.add(job.name)
        await run_jobs(
            self.nc,
            self.settings,
            jobs,
            timeout_s=JOB_TIMEOUT_S,
            worker=self.proc,
            log=self.log,
            linger_s=0.1,  # a second result message for a task would arrive by now
        )
        for job in jobs:
            job.results = await job_results(self.nc.jetstream(), self.settings, job.name)
            check_job(job, self.declared[job.pipeline])
        return jobs

    async def models(self) -> dict[str, float]:
        """The worker's model metrics now (docs/pipelines.md, "Several pipelines")."""
        text = await asyncio.to_thread(scrape, self.metrics_port)
        return model_metrics(text)

    async def batched(self, jobs: list[Job]) -> tuple[list[Job], dict[str, float]]:
        """``run(jobs)``, and what the worker's metrics counted meanwhile: images per batch,
        model loads and seconds loading."""
        before = await self.models()
        done = await self.run(jobs)
        after = await self.models()
        batches = after["batches"] - before["batches"]
        return done, {
            "images_per_batch": round((after["images"] - before["images"]) / max(1.0, batches), 2),
            "model_loads": after["loads"] - before["loads"],
            "load_seconds": round(after["load_seconds"] - before["load_seconds"], 2),
        }


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        return str(answer.read().decode())


def model_metrics(text: str) -> dict[str, float]:
    """Pipelines resident, their bytes, and loads, evictions and load seconds summed over the
    pipelines, and the images and batches run, from a /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {
        f"{PREFIX}_models_resident": "resident",
        f"{PREFIX}_model_bytes": "resident_bytes",
        f"{PREFIX}_model_budget_bytes": "budget_bytes",
        f"{PREFIX}_model_loads_total": "loads",
        f"{PREFIX}_model_load_failures_total": "load_failures",
        f"{PREFIX}_model_evictions_total": "evictions",
        f"{PREFIX}_model_load_seconds_total": "load_seconds",
        f"{PREFIX}_images_total": "images",
        f"{PREFIX}_batches_total": "batches",
    }
    out = dict.fromkeys(wanted.values(), 0.0)
    found = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                out[wanted[sample.name]] += float(sample.value)
                found.add(sample.name)
    if found != set(wanted):
        raise BenchmarkFailed(f"/metrics lacks {sorted(set(wanted) - found)}")
    return out


@asynccontextmanager
async def serving(
    w: World,
    log: str,
    pipelines: list[Declared],
    sizes: Sizes,
    *,
    fair: bool = True,
    env: dict[str, str] | None = None,
) -> AsyncIterator[Serving]:
    """`inference-worker run` serving ``pipelines`` (TOML files) on a consumer of its own,
    streams provisioned first; it must exit 0 when stopped."""
    consumer = log.removesuffix(".log")
    settings = load_settings(
        for_worker=False, nats={"url": w.nats.url, "consumer": consumer, "fair_jobs": fair}
    ).nats
    port = free_port()
    async with client(settings, [p.name for p in pipelines]) as nc:
        proc = start_worker(
            w,
            log,
            **{
                env_name("model", "pipelines"): ",".join(p.toml for p in pipelines),
                env_name("model", "weights"): "",
                env_name("nats", "consumer"): consumer,
                env_name("nats", "fair_jobs"): str(fair).lower(),
                env_name("metrics", "port"): str(port),
                env_name("metrics", "healthz_port"): str(free_port()),
                env_name("loader", "num_workers"): str(sizes.loader_workers),
                **(
                    {env_name("nats", "job_discovery_s"): str(sizes.discovery_s)}
                    if sizes.discovery_s
                    else {}
                ),
                **(env or {}),
            },
        )
        declared = {p.name: p for p in pipelines}
        try:
            yield Serving(w, nc, settings, proc, port, w.workdir / log, declared)
        finally:
            code = stop_worker(proc)
    if code != 0:
        raise BenchmarkFailed(f"{log}: the worker exited {code} when stopped")


# -- switch ----------------------------------------------------------------------------------
def switch(w: World, sizes: Sizes) -> dict[str, Any]:
    """Model switch cost, in-process through the worker's cache: hit, disk, S3 (medians)."""
    from dataclasses import replace

    from datasets.uris import SourceConfig
    from pipelines.cache import ModelCache
    from pipelines.registry import resolve
    from pipelines.runner import Runner, load_runner

    declared = declare(w.workdir, "switch", 5, ARCH)
    s3 = w.s3.client()
    s3.create_bucket(Bucket="models")
    for name in ("model.pt", "labels.txt"):
        s3.upload_file(str(declared.weights.parent / name), "models", f"switch/{name}")
    disk = resolve(declared.toml)
    assert disk.classifier is not None
    on_s3 = replace(
        disk, classifier=replace(disk.classifier, weights="s3://models/switch/model.pt")
    )
    sources = SourceConfig(s3_endpoint_url=w.s3.endpoint_url)
    declared_as = {"disk": disk, "s3": on_s3}
    cache: ModelCache[Runner] = ModelCache(
        lambda name: load_runner(declared_as[name], sources, "cpu"), Runner.weights_bytes, 1 << 40
    )
    timings = switch_timings(cache, sizes)
    cache.load("disk")
    same = same_as_original(cache.peek("disk"), cache.peek("s3"), declared)
    return {
        "architecture": ARCH,
        "model_file_bytes": declared.weights.stat().st_size,
        "loads_each": sizes.switch_loads,
        "hits": sizes.switch_hits,
        "cache_hit_ms": round(1000 * median(timings["hit"]), 5),
        "load_from_disk_ms": round(1000 * median(timings["disk"]), 1),
        "load_from_s3_ms": round(1000 * median(timings["s3"]), 1),
        "load_from_disk_ms_all": [round(1000 * t, 1) for t in timings["disk"]],
        "load_from_s3_ms_all": [round(1000 * t, 1) for t in timings["s3"]],
        **same,
    }


def switch_timings(cache: Any, sizes: Sizes) -> dict[str, list[float]]:
    """Seconds of each load from disk and from S3 (nothing resident before it), and of each
    cache hit."""
    timings: dict[str, list[float]] = {"disk": [], "s3": [], "hit": []}
    for round_ in range(sizes.switch_loads + 1):  # round 0 warms up (imports, page cache)
        for name in ("disk", "s3"):
            cache.close()  # nothing resident: the next acquire loads
            started = time.perf_counter()
            cache.acquire(name)
            if round_:
                timings[name].append(time.perf_counter() - started)
            cache.release(name)
    for _ in range(sizes.switch_hits):
        started = time.perf_counter()
        cache.acquire("s3")
        timings["hit"].append(time.perf_counter() - started)
        cache.release("s3")
    return timings


def same_as_original(disk: Any, s3: Any, declared: Declared) -> dict[str, Any]:
    """The two loaded runners against the model built straight from the weights file: the
    same sha256, the same logits from disk and S3, the original's logits (the worker folds
    batch norms: equal to float error) and top classes. BenchmarkFailed otherwise."""
    import torch

    from pipelines.architectures import build_classifier
    from pipelines.declare import IMAGENET_MEAN, IMAGENET_STD

    assert disk is not None and s3 is not None and disk.classifier and s3.classifier
    torch.manual_seed(0)
    batch = torch.randint(0, 256, (8, 3, 224, 224), dtype=torch.uint8)
    original = build_classifier(ARCH, 10)
    original.load_state_dict(torch.load(declared.weights, weights_only=True))
    original.eval()
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    with torch.inference_mode():
        expected = original((batch.float() / 255 - mean) / std)
    from_disk, from_s3 = disk.classifier.logits(batch), s3.classifier.logits(batch)
    diff = float((from_disk - expected).abs().max())
    shas = {a.weights_sha256 for r in (disk, s3) for a in r.algorithms()}
    checks = {
        "same_sha256": shas == {declared.sha256},
        "s3_equals_disk_logits": bool(torch.equal(from_disk, from_s3)),
        "same_top_class_as_original": bool(torch.equal(from_disk.argmax(1), expected.argmax(1))),
        "original_logits_close": diff <= 1e-3 * max(1.0, float(expected.abs().max())),
    }
    if not all(checks.values()):
        raise BenchmarkFailed(f"switch: the loaded models are not the original: {checks}")
    return {**checks, "max_abs_logit_diff_to_original": diff}


# -- interleaved -----------------------------------------------------------------------------
async def interleaved(w: World, uris: list[str], sizes: Sizes) -> dict[str, Any]:
    """Two pipelines' jobs alone and together in one worker; then together under a budget
    that holds one model only (a batch of the other pipeline is a switch)."""
    a = declare(w.workdir, "alpha", 1, FAST_ARCH)
    b = declare(w.workdir, "beta", 2, FAST_ARCH)
    tasks = cycle(uris, sizes.interleaved_tasks)
    rounds = []
    async with serving(w, "interleaved.log", [a, b], sizes) as s:
        await s.run([Job("warm-a", uris[:8], a.name), Job("warm-b", uris[:8], b.name)])
        for r in range(sizes.interleaved_rounds):
            (alone_a,), counted_a = await s.batched([Job(f"alone-a-{r}", tasks, a.name)])
            (alone_b,), counted_b = await s.batched([Job(f"alone-b-{r}", tasks, b.name)])
            both, counted = await s.batched(
                [Job(f"both-a-{r}", tasks, a.name), Job(f"both-b-{r}", tasks, b.name)]
            )
            rounds.append(interleaved_round(alone_a, alone_b, both))
            rounds[-1]["images_per_batch_alone"] = (
                counted_a["images_per_batch"] + counted_b["images_per_batch"]
            ) / 2
            rounds[-1]["images_per_batch_together"] = counted["images_per_batch"]
        loads = (await s.models())["loads"]
    medians = {key: round(median([r[key] for r in rounds]), 2) for key in rounds[0]}
    alone = (
        medians["alpha_alone_steady_images_per_s"] + medians["beta_alone_steady_images_per_s"]
    ) / 2
    return {
        "architecture": FAST_ARCH,
        "tasks_per_job": len(tasks),
        "rounds": rounds,
        **medians,
        "together_to_mean_alone_steady": round(medians["together_steady_images_per_s"] / alone, 3),
        "models_loaded_ample_budget": loads,
        "budget_fits_one": await interleaved_fits_one(w, uris, sizes, a, b),
    }


async def interleaved_fits_one(
    w: World, uris: list[str], sizes: Sizes, a: Declared, b: Declared
) -> dict[str, Any]:
    """Both jobs together under a memory budget that holds one of the two models."""
    one = int(1.5 * loaded_bytes(a))
    tasks = cycle(uris, sizes.interleaved_tasks)
    env = {env_name("model", "memory_budget_bytes"): str(one)}
    async with serving(w, "interleaved-fits-1.log", [a, b], sizes, env=env) as s:
        await s.run([Job("warm-a", uris[:8], a.name), Job("warm-b", uris[:8], b.name)])
        both, counted = await s.batched(
            [Job("both-a", tasks, a.name), Job("both-b", tasks, b.name)]
        )
    last, first = max(j.done_at for j in both), min(j.first_at for j in both)
    return {
        "budget_bytes": one,
        "together_images_per_s": round(2 * len(tasks) / last, 1),
        "together_steady_images_per_s": round((2 * len(tasks) - 1) / max(1e-6, last - first), 1),
        **counted,
    }


def interleaved_round(alone_a: Job, alone_b: Job, both: list[Job]) -> dict[str, float]:
    """Images/s from the first publish to the last result, and steady (from the first result
    to the last: without the wait for a new job's discovery and the pipeline's fill)."""
    n = len(alone_a.uris)
    together = 2 * n / max(j.done_at for j in both)
    steady = (2 * n - 1) / max(1e-6, max(j.done_at for j in both) - min(j.first_at for j in both))
    return {
        "alpha_alone_images_per_s": n / alone_a.done_at,
        "beta_alone_images_per_s": n / alone_b.done_at,
        "together_images_per_s": together,
        "alpha_alone_steady_images_per_s": (n - 1) / max(1e-6, alone_a.done_at - alone_a.first_at),
        "beta_alone_steady_images_per_s": (n - 1) / max(1e-6, alone_b.done_at - alone_b.first_at),
        "together_steady_images_per_s": steady,
        "alpha_done_together_s": both[0].done_at,
        "beta_done_together_s": both[1].done_at,
    }


# -- fairness --------------------------------------------------------------------------------
async def fairness(w: World, uris: list[str], sizes: Sizes) -> dict[str, Any]:
    """A small job published right after a big one: fair share off (stream order), on (the
    default discovery interval), and on with a shorter one (``fast_discovery_s``)."""
    out: dict[str, Any] = {"big_tasks": sizes.big, "small_tasks": sizes.small}
    modes = [("off", False, 0.0), ("on", True, 0.0)]
    if sizes.fast_discovery_s:
        modes.append(("on-fast-discovery", True, sizes.fast_discovery_s))
    for mode, fair, discovery_s in modes:
        env = {env_name("nats", "job_discovery_s"): str(discovery_s)} if discovery_s else {}
        p = declare(w.workdir, f"fair-{mode}", 3, FAST_ARCH)  # a pipeline per mode: no old jobs
        async with serving(w, f"fair-{mode}.log", [p], sizes, fair=fair, env=env) as s:
            await s.run([Job(f"warm-{mode}", uris[:8], p.name)])
            singles = [
                (await s.run([Job(f"one-{mode}-{i}", [uris[i % len(uris)]], p.name)]))[0].done_at
                for i in range(sizes.one_image_jobs)
            ]
            runs = []
            for r in range(sizes.fair_runs):
                big = Job(f"big-{mode}-{r}", cycle(uris, sizes.big), p.name)
                small = Job(f"small-{mode}-{r}", cycle(uris[::-1], sizes.small), p.name)
                runs.append(fair_run(*await s.run([big, small])))
        out[mode] = fair_summary(runs, singles, discovery_s)
    return out


def fair_summary(runs: list[dict[str, float]], singles: list[float], discovery_s: float) -> Any:
    shares = [r["small_done_share_of_big"] for r in runs]
    return {
        "job_discovery_s": discovery_s or "default",
        "one_image_job_latency_ms_median": round(1000 * median(singles), 1),
        "one_image_job_latency_ms_max": round(1000 * max(singles), 1),
        "runs": runs,
        "small_done_share_of_big_median": median(shares),
        "small_done_share_of_big_max": max(shares),
        "longest_gap_small_s_max": max(r["longest_gap_small_s"] for r in runs),
        "longest_gap_big_s_max": max(r["longest_gap_big_s"] for r in runs),
        "goal_small_within_10_percent_every_run": max(shares) <= 0.1,
    }


def fair_run(big: Job, small: Job) -> dict[str, float]:
    """Times from the big job's first publish; gaps while both jobs were pending."""
    both_until = min(big.done_at, small.done_at)
    return {
        "big_done_s": round(big.done_at, 3),
        "small_published_s": round(small.published_at, 3),
        "small_first_result_s": round(min(small.arrivals.values()), 3),
        "small_done_s": round(small.done_at, 3),
        "small_done_share_of_big": round(small.done_at / big.done_at, 3),
        "longest_gap_small_s": round(small.longest_gap(both_until), 3),
        "longest_gap_big_s": round(big.longest_gap(both_until), 3),
    }


# -- memory ----------------------------------------------------------------------------------
async def memory(w: World, uris: list[str], sizes: Sizes) -> dict[str, Any]:
    """N pipelines served in turn (``memory_passes`` times) under a budget that fits
    ``memory_fits`` of them, and under one that fits all; the answers must not change."""
    n, fits = sizes.memory_pipelines, sizes.memory_fits
    declared = [declare(w.workdir, f"m{i:02d}", 10 + i, sizes.memory_arch) for i in range(n)]
    each = loaded_bytes(declared[0])
    out: dict[str, Any] = {
        "pipelines": n,
        "architecture": sizes.memory_arch,
        "tasks_per_job": sizes.memory_tasks,
        "passes": sizes.memory_passes,
        "model_loaded_bytes": each,
        "model_file_bytes": declared[0].weights.stat().st_size,
    }
    answers: dict[str, dict[tuple[int, str, str], tuple[str, list[float]]]] = {}
    for label, budget in (
        (f"fits_{fits}", int(each * (fits + 0.5))),
        (f"fits_{n}", int(each * (n + 0.5))),
    ):
        out[label], answers[label] = await memory_run(w, uris, sizes, declared, label, budget)
        if out[label]["peak_models_resident"] > budget // each:
            raise BenchmarkFailed(f"memory {label}: more models resident than the budget fits")
    out["answers_compared"] = same_answers(*answers.values())
    return out


async def memory_run(
    w: World, uris: list[str], sizes: Sizes, declared: list[Declared], label: str, budget: int
) -> tuple[dict[str, Any], dict[tuple[int, str, str], tuple[str, list[float]]]]:
    answers: dict[tuple[int, str, str], tuple[str, list[float]]] = {}
    peak = {"resident": 0.0, "resident_bytes": 0.0}
    env = {env_name("model", "memory_budget_bytes"): str(budget)}
    async with serving(w, f"memory-{label}.log", declared, sizes, env=env) as s:
        with PeakRss(pids=lambda: [s.proc.pid]) as rss:
            for p in range(sizes.memory_passes):
                for d in declared:
                    (job,) = await s.run(
                        [Job(f"{label}-{p}-{d.name}", uris[: sizes.memory_tasks], d.name)]
                    )
                    now = await s.models()
                    peak = {k: max(v, now[k]) for k, v in peak.items()}
                    for result in job.results:
                        answers[(p, d.name, str(result["task_id"]))] = classification(result)
            final = await s.models()
            rss_after = psutil.Process(s.proc.pid).memory_info().rss
    if peak["resident_bytes"] > budget:
        raise BenchmarkFailed(f"memory {label}: {peak['resident_bytes']} bytes over the budget")
    return {
        "budget_bytes": budget,
        "peak_models_resident": int(peak["resident"]),
        "peak_resident_bytes": int(peak["resident_bytes"]),
        "loads": int(final["loads"]),
        "evictions": int(final["evictions"]),
        "load_failures": int(final["load_failures"]),
        "mean_load_ms_in_worker": round(1000 * final["load_seconds"] / max(1.0, final["loads"]), 1),
        "main_rss_bytes_peak": rss.peak_bytes,
        "main_rss_bytes_after": rss_after,
    }, answers


def same_answers(
    a: dict[tuple[int, str, str], tuple[str, list[float]]],
    b: dict[tuple[int, str, str], tuple[str, list[float]]],
) -> dict[str, Any]:
    """Every task's label equal under both budgets (and from pass to pass), scores within
    1e-5; BenchmarkFailed otherwise."""
    first = {k: v for k, v in a.items() if k[0] == 0}
    pairs = [(a[k], b.get(k)) for k in a] + [(v, a.get((1, *k[1:]), v)) for k, v in first.items()]
    if set(a) != set(b) or any(y is None for _, y in pairs):
        raise BenchmarkFailed("memory: the two budgets answered different tasks")
    labels_differ = sum(x[0] != y[0] for x, y in pairs if y is not None)
    diff = max(
        (abs(p - q) for x, y in pairs if y is not None for p, q in zip(x[1], y[1], strict=True)),
        default=0.0,
    )
    if labels_differ or diff > 1e-5:
        raise BenchmarkFailed(f"memory: answers changed: {labels_differ} labels, scores by {diff}")
    return {"tasks": len(a), "labels_differ": labels_differ, "max_score_diff": diff}


# -- the run ---------------------------------------------------------------------------------
CASES = ("switch", "interleaved", "fairness", "memory")


async def run(cases: list[str], sizes: Sizes) -> dict[str, Any]:
    result: dict[str, Any] = {"machine": machine(), "sizes": asdict(sizes)}
    with world() as w:
        try:
            uris = upload(w.s3.client(), "pipelines", list(sizes.image_sizes), sizes.images)
            for case in cases:
                started = time.perf_counter()
                if case == "switch":
                    result[case] = switch(w, sizes)
                else:
                    result[case] = await {
                        "interleaved": interleaved,
                        "fairness": fairness,
                        "memory": memory,
                    }[case](w, uris, sizes)
                result[case]["case_wall_s"] = round(time.perf_counter() - started, 1)
        finally:
            # The workdir stays for its logs; the weights (about 0.5 GB) do not.
            for weights in w.workdir.glob("*/model.pt"):
                weights.unlink()
    return result


@refusing
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--smoke", action="store_true", help="tiny and quick: outcomes only")
    args = parser.parse_args()
    cases = [case for case in args.cases.split(",") if case]
    unknown = set(cases) - set(CASES)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; known: {', '.join(CASES)}")
    started = time.perf_counter()
    result = asyncio.run(run(cases, SMOKE if args.smoke else Sizes()))
    result.update(stamp("pipelines"))
    result["wall_s"] = round(time.perf_counter() - started, 1)
    save("pipelines", result, echo=True)


if __name__ == "__main__":
    main()
