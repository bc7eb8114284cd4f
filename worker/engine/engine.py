"""The engine: a batch's images collected and its forward pass run, on one dedicated thread,
composed of the package's pieces (one job each). Knows nothing of NATS."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence

from config.errors import DeviceFailed, Failure, ModelLoadFailed
from datasets.images import DecodePlan
from datasets.loader import Loaded, LoadRequest, StreamingLoader
from datasets.reads import ReadStats
from pipelines.device import release_cached_memory, sticky_cause
from worker.core.outcome import Outcome
from worker.core.ports import BatchReport
from worker.engine.collect import Collector
from worker.engine.copy_ahead import CopyAhead
from worker.engine.forward import Forward
from worker.engine.predictors import Models, OneModel, Predictor
from worker.engine.read_stats import Reads
from worker.engine.recovery import Recovery
from worker.engine.split import Split, device_failed
from worker.engine.stash import Stash


class Engine:
    """Owns the persistent loader and the models. ``run_batch`` is called on one thread only.

    Every batch is one pipeline's: its model is acquired for the batch and released after,
    images are loaded by that pipeline's decode plan (``plans``), and only images of the same
    pipeline are copied ahead while it runs."""

    def __init__(
        self,
        loader: StreamingLoader,
        predictor: Predictor | None = None,
        max_consecutive_failures: int = 3,
        heartbeat: Callable[[], None] = lambda: None,
        release_memory: Callable[[], None] = release_cached_memory,
        *,
        models: Models | None = None,
        plans: dict[str, DecodePlan] | None = None,
    ) -> None:
        self.loader = loader
        if models is None:
            assert predictor is not None, "a predictor or the models"
            models = OneModel(predictor)
        self.models = models
        self._plans = dict(plans or {})
        self.stash = Stash()
        self.recovery = Recovery(loader, max_consecutive_failures, heartbeat)
        self._reads = Reads()
        self._collector = Collector(loader, self.stash, self.recovery, self._reads)
        self.copy_ahead = CopyAhead(self.stash, self._collector.take_ready, release_memory)
        self._split = Split(release_memory, on_out_of_memory=self.copy_ahead.pause)

    # -- what the metrics and benchmarks read ---------------------------------------------

    @property
    def out_of_memory(self) -> int:
        """Batches split for lack of device memory (a metric)."""
        return self._split.out_of_memory

    @property
    def read_retries(self) -> Counter[str]:
        """The loader children's read retries by reason, since the start (a metric)."""
        return self._reads.retries

    def reads(self) -> list[ReadStats]:
        """The current loader children's reads, as each last reported them; any thread."""
        return self._reads.of(self.loader.child_pids())

    @property
    def ran_copied_ahead(self) -> int:
        """Images that were on the device before their batch ran (a benchmark's count)."""
        return self.copy_ahead.ran_copied_ahead

    @property
    def consecutive_failures(self) -> int:
        """Batches in a row whose loads the loader failed."""
        return self.recovery.consecutive_failures

    # -- the BatchEngine -------------------------------------------------------------------

    def start(self) -> None:
        self.loader.start()

    def close(self) -> None:
        self.loader.close()
        self.stash.clear()
        self.copy_ahead.clear()

    def ready(self, pipeline: str) -> bool:
        return self.models.ready(pipeline)

    def load(self, pipeline: str) -> Failure | None:
        """Make ``pipeline``'s models resident (any thread); the failure its tasks get when
        they cannot be."""
        try:
            self.models.load(pipeline)
        except ModelLoadFailed as failed:
            return _failure_unless_device(failed)
        return None

    def submit(self, requests: Sequence[tuple[int, str]], pipeline: str = "") -> None:
        """Queue loads of (key, URI) for ``pipeline``; any thread. Loader children start on
        them at once, decoding by that pipeline's plan."""
        plan = self._plans.get(pipeline)
        self.stash.submit([key for key, _ in requests], pipeline)
        self.loader.submit([LoadRequest(key, uri, plan) for key, uri in requests])

    def forget(self, keys: Sequence[int]) -> None:
        """Drop loads that nobody will collect (tasks given back at shutdown, or failed)."""
        self.stash.forget(keys)
        self.copy_ahead.forget(keys)

    def run_batch(self, keys: Sequence[int], pipeline: str = "") -> BatchReport:
        """One pipeline's batch: its model held for the batch, never unloaded meanwhile. A
        sticky device error met anywhere in it (the forward pass, trimming the allocator's
        cache, a model's release) ends it as DeviceFailed: the process's end, no image's."""
        try:
            return self._held_batch(keys, pipeline)
        except DeviceFailed:
            raise
        except Exception as error:
            sticky = sticky_cause(error)
            if sticky is None:
                raise
            raise device_failed(sticky) from error

    def _held_batch(self, keys: Sequence[int], pipeline: str) -> BatchReport:
        try:
            predictor = self.models.acquire(pipeline)  # loaded already, unless evicted since
        except ModelLoadFailed as failed:
            self.forget(keys)
            failure = _failure_unless_device(failed)
            outcomes = {key: Outcome(failure=failure) for key in keys}
            return BatchReport(outcomes, 0.0, 0.0, 0)
        self.copy_ahead.begin(pipeline, predictor)
        try:
            return self._run_batch(keys, predictor)
        finally:
            self.copy_ahead.end()
            self.models.release(pipeline)

    def _run_batch(self, keys: Sequence[int], predictor: Predictor) -> BatchReport:
        self.stash.dequeue(keys)
        restarts_before = self.loader.restarts
        self.recovery.replace_unhealthy()
        started = time.perf_counter()
        loaded, failure = self._collector.collect(keys)
        self.recovery.count(failure)
        load_s = time.perf_counter() - started
        outcomes = _not_loaded(keys, loaded, failure)
        ready = [key for key in keys if key not in outcomes]
        infer_started, prepared_s = time.perf_counter(), self.copy_ahead.prepared_s
        outcomes.update(self._split.infer(ready, Forward(predictor, loaded, self.copy_ahead)))
        infer_s = time.perf_counter() - infer_started - (self.copy_ahead.prepared_s - prepared_s)
        return BatchReport(outcomes, load_s, infer_s, self.loader.restarts - restarts_before)


def _failure_unless_device(failed: ModelLoadFailed) -> Failure:
    """What a model that could not be loaded gives its tasks; DeviceFailed when the device
    failed for good under the load (a sticky CUDA error is no fault of the pipeline's)."""
    sticky = sticky_cause(failed.cause) if failed.cause is not None else None
    if sticky is not None:
        raise device_failed(sticky) from sticky
    return failed.failure


def _not_loaded(
    keys: Sequence[int], loaded: dict[int, Loaded], failure: str | None
) -> dict[int, Outcome]:
    """The outcomes of ``keys`` that have no image: lost with a broken loader (``failure``),
    or failed to load (their own failure)."""
    outcomes: dict[int, Outcome] = {}
    for key in keys:
        item = loaded.get(key)
        if item is None:
            lost = Failure("loader_failed", failure or "the loader lost it", retryable=True)
            outcomes[key] = Outcome(failure=lost)
        elif item.image is None:
            outcomes[key] = Outcome(failure=item.failure, timings_s={"load_s": item.load_s})
    return outcomes
