"""Prometheus metrics in one injected registry, and the collectors read at scrape time."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from config.errors import LOAD_REASONS
from config.names import env_name
from datasets.reads import ReadStats
from worker.core.ports import SourceHealth
from worker.health.liveness import Liveness

PREFIX = "inference_worker"
# The ``pipeline`` label of what a task names that this process does not serve: the label's
# values stay the served pipelines (and this), whatever a task names.
OTHER_PIPELINE = "other"
OUTCOMES = ("ok", "error", "retried", "dead_lettered")
STAGES = ("load", "infer", "store")


class Metrics:
    """Every metric of the worker, registered in the registry it is given."""

    def __init__(
        self,
        registry: CollectorRegistry,
        liveness: Liveness,
        source: str = "nats",
        source_health: Callable[[], SourceHealth] = lambda: SourceHealth(True, 0.0),
        pipelines: Sequence[str] = (),
    ) -> None:
        self.registry = registry
        self._pipelines = frozenset(pipelines)
        _source_gauges(registry, source, source_health)
        _state_gauges(registry, liveness)
        self.tasks = Counter(
            f"{PREFIX}_tasks",
            "Tasks settled, by outcome (ok, error, retried, dead_lettered) and pipeline (a "
            f"served one, or {OTHER_PIPELINE}).",
            ["outcome", "pipeline"],
            registry=registry,
        )
        self.results_already_stored = Counter(
            f"{PREFIX}_results_already_stored",
            "Results not written because the task's result was already stored: a second "
            "completion of one task (the store keeps the first).",
            registry=registry,
        )
        self.images = Counter(
            f"{PREFIX}_images", "Images run through the model.", registry=registry
        )
        self.batches = Counter(f"{PREFIX}_batches", "Batches completed.", registry=registry)
        self.batch_seconds = Histogram(
            f"{PREFIX}_batch_duration_seconds",
            "Time per batch, by stage (load, infer, store) and pipeline.",
            ["stage", "pipeline"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=registry,
        )
        for pipeline in pipelines:  # every series there from the start
            for outcome in OUTCOMES:
                self.tasks.labels(outcome, pipeline)
            for stage in STAGES:
                self.batch_seconds.labels(stage, pipeline)
        self.tasks_dropped = _dropped_counter(registry)
        self.loader_restarts = Counter(
            f"{PREFIX}_loader_restarts",
            "DataLoader rebuilds after a timeout or a dead loader child.",
            registry=registry,
        )
        self.device, self.start_time = _process_identity(registry)

    def pipeline(self, name: str) -> str:
        """The ``pipeline`` label for a task naming ``name``: a served pipeline's own name,
        else ``other`` (a task's pipeline is untrusted: it never makes a series of its own)."""
        return name if name in self._pipelines else OTHER_PIPELINE

    def count_task(self, outcome: str, pipeline: str) -> None:
        self.tasks.labels(outcome, self.pipeline(pipeline)).inc()

    def observe_stage(self, stage: str, pipeline: str, seconds: float) -> None:
        self.batch_seconds.labels(stage, self.pipeline(pipeline)).observe(seconds)


def _dropped_counter(registry: CollectorRegistry) -> Counter:
    dropped = Counter(
        f"{PREFIX}_tasks_dropped",
        "Held tasks dropped before they ran, nothing settled at the source, by reason "
        "(job_inactive: the source no longer shows their job as active).",
        ["reason"],
        registry=registry,
    )
    dropped.labels("job_inactive")
    return dropped


def _process_identity(registry: CollectorRegistry) -> tuple[Info, Gauge]:
    """Which process this is: the device it runs on (set once the device is claimed) and
    when it started (set now)."""
    device = Info(
        f"{PREFIX}_device",
        "The device this process runs on (1): device (cuda:0, cpu), the GPU's UUID and the "
        "MIG slice's GPU_I_ID as dcgm-exporter labels them (join on both), mig_uuid, name, "
        "torch_version, cuda_version, driver_version; empty where unknown.",
        registry=registry,
    )
    start_time = Gauge(
        f"{PREFIX}_start_time_seconds",
        "When this process started (Unix time): each restart changes it, also one that "
        "ends before any batch (InferenceWorkerRestartingOften).",
        registry=registry,
    )
    start_time.set(time.time())
    return device, start_time


def _source_gauges(
    registry: CollectorRegistry, source: str, health: Callable[[], SourceHealth]
) -> None:
    """Whether the task source answers, for either source (``source``: WORKER_SOURCE)."""
    Gauge(
        f"{PREFIX}_source_connected",
        "1 while the task source answers (NATS: the connection is up; Antenna: its calls "
        "answer); 0 while it does not.",
        ["source"],
        registry=registry,
    ).labels(source).set_function(lambda: 1.0 if health().connected else 0.0)
    Gauge(
        f"{PREFIX}_source_down_seconds",
        "Seconds since the task source last answered; 0 while it does.",
        ["source"],
        registry=registry,
    ).labels(source).set_function(lambda: health().down_s)


def _state_gauges(registry: CollectorRegistry, liveness: Liveness) -> None:
    """The gauges read at each scrape: progress, tasks held, stalled."""
    Gauge(
        f"{PREFIX}_last_progress_timestamp_seconds",
        "Unix time work last advanced (a batch, or a chunk of one, done), or of the last "
        "moment no work was held.",
        registry=registry,
    ).set_function(liveness.last_progress)
    Gauge(
        f"{PREFIX}_inflight_tasks",
        "Tasks held: fetched, not yet acked or naked.",
        registry=registry,
    ).set_function(lambda: liveness.held)
    Gauge(
        f"{PREFIX}_stalled",
        "1 while tasks are held and no work advanced (a batch or a chunk of one) for the "
        "stall timeout.",
        registry=registry,
    ).set_function(lambda: 1.0 if liveness.stalled_reason() else 0.0)


class DeviceCollector:
    """Device memory of this process (allocated, reserved, peak) and the batches split for lack
    of it. ``memory`` returns nothing off CUDA, and then no memory series is exported."""

    def __init__(
        self, memory: Callable[[], dict[str, float]], out_of_memory: Callable[[], int]
    ) -> None:
        self._memory = memory
        self._out_of_memory = out_of_memory

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        values = self._memory()
        if values:
            family = GaugeMetricFamily(
                f"{PREFIX}_device_memory_bytes",
                "CUDA memory of this process: allocated, reserved (the caching allocator's), "
                "peak allocated.",
                labels=["kind"],
            )
            for kind, value in values.items():
                family.add_metric([kind], value)
            yield family
        yield CounterMetricFamily(
            f"{PREFIX}_out_of_memory_splits",
            "Batches halved after running out of device memory.",
            value=float(self._out_of_memory()),
        )


class ReadsCollector:
    """The loader children's object reads: in flight, the encoded bytes they hold, and the
    retries made (stalled, throttled, unavailable)."""

    def __init__(
        self, reads: Callable[[], list[ReadStats]], retries: Callable[[], dict[str, int]]
    ) -> None:
        self._reads = reads
        self._retries = retries

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        reads = self._reads()
        yield GaugeMetricFamily(
            f"{PREFIX}_loader_reads_in_flight",
            "Object reads the loader children hold (reading, or read and waiting to be "
            "decoded), as each child last reported.",
            value=float(sum(r.in_flight for r in reads)),
        )
        held = GaugeMetricFamily(
            f"{PREFIX}_loader_read_bytes",
            "Encoded bytes the loader children hold for their reads: now (held) and the most "
            "at once since each child started (peak), summed over children.",
            labels=["kind"],
        )
        held.add_metric(["held"], float(sum(r.held_bytes for r in reads)))
        held.add_metric(["peak"], float(sum(r.peak_bytes for r in reads)))
        yield held
        retries = CounterMetricFamily(
            f"{PREFIX}_source_retries",
            "Object reads made again: stalled (no byte for "
            f"{env_name('s3', 'read_timeout_s')}, retried on a new connection), throttled "
            "(429, 503 SlowDown: after a backoff), unavailable.",
            labels=["reason"],
        )
        counts = self._retries()
        for reason in ("stalled", "throttled", "unavailable"):
            retries.add_metric([reason], float(counts.get(reason, 0)))
        yield retries


class UnavailableCollector:
    """``inference_worker_pipeline_unavailable{pipeline,reason}``: 1 for each served pipeline
    whose models cannot be loaded on this host, under the reason why, 0 under the others."""

    def __init__(
        self, pipelines: tuple[str, ...], unavailable: Callable[[], dict[str, str]]
    ) -> None:
        self._pipelines = pipelines
        self._unavailable = unavailable  # pipeline -> "reason: error"

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        lost = {name: why.partition(":")[0] for name, why in self._unavailable().items()}
        family = GaugeMetricFamily(
            f"{PREFIX}_pipeline_unavailable",
            "1 while a served pipeline's models cannot be loaded on this host, by pipeline and "
            "reason (download_refused, cache_unwritable, over_budget, load_timeout, "
            "load_failed): its tasks "
            "are given back and none fetched; its load is retried in the background.",
            labels=["pipeline", "reason"],
        )
        for name in self._pipelines:
            for reason in LOAD_REASONS:
                family.add_metric([name, reason], 1.0 if lost.get(name) == reason else 0.0)
        yield family


class ModelsCollector:
    """The models on demand (``pipelines.cache.ModelCache``): how many pipelines are loaded,
    their bytes, and per pipeline the loads, failed loads, unloads and seconds spent loading."""

    def __init__(self, cache: Any, pipelines: list[str]) -> None:
        self._cache = cache
        self._pipelines = pipelines

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        resident = self._cache.resident()
        stats = self._cache.stats
        yield GaugeMetricFamily(
            f"{PREFIX}_models_resident",
            "Pipelines whose models are loaded now.",
            value=float(len(resident)),
        )
        sized = GaugeMetricFamily(
            f"{PREFIX}_model_bytes",
            "Bytes of each pipeline's loaded models (0 when not loaded), and the budget.",
            labels=["pipeline"],
        )
        for name in self._pipelines:
            sized.add_metric([name], float(resident.get(name, 0)))
        yield sized
        yield GaugeMetricFamily(
            f"{PREFIX}_model_budget_bytes",
            "The memory budget the loaded models share "
            f"({env_name('model', 'memory_budget_bytes')}).",
            value=float(self._cache.budget_bytes),
        )
        for name, help_text, counts in (
            ("model_loads", "Model loads, by pipeline.", stats.loads),
            ("model_load_failures", "Model loads that failed, by pipeline.", stats.load_failures),
            (
                "model_evictions",
                "Models unloaded (idle, or for room), by pipeline.",
                stats.evictions,
            ),
            (
                "model_load_seconds",
                "Seconds spent loading models, by pipeline.",
                stats.load_seconds,
            ),
        ):
            family = CounterMetricFamily(f"{PREFIX}_{name}", help_text, labels=["pipeline"])
            for pipeline in self._pipelines:
                family.add_metric([pipeline], float(counts.get(pipeline, 0)))
            yield family
