"""Loader iteration and forward passes, on one dedicated thread. Knows nothing of NATS."""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import structlog

from config.errors import Failure, LoaderFailure, LoaderGaveUp, ModelLoadFailed, PermanentError
from datasets.images import Decoded, DecodePlan
from datasets.loader import Loaded, LoadRequest, StreamingLoader
from datasets.reads import ReadStats
from pipelines.device import is_out_of_memory, release_cached_memory
from worker.outcome import Outcome
from worker.ports import BatchReport

log = structlog.get_logger(__name__)


class Predictor(Protocol):
    """A pipeline's forward pass (``pipelines.runner.Runner``): per image, its detections."""

    @property
    def copy_ahead_images(self) -> int:
        """Images of the next batch to put on the device while one runs (0: none)."""
        ...

    def copy_ahead(self, images: Sequence[Decoded]) -> list[Decoded]:
        """``images`` on their way to the device; the host does not wait for the copies."""
        ...

    def run(
        self, images: Sequence[Decoded], while_running: Callable[[], None]
    ) -> list[list[dict[str, Any]]]:
        """Calls ``while_running`` once, while the device computes the batch."""
        ...


class Models(Protocol):
    """The pipelines' models on demand (``pipelines.cache.ModelCache``): a batch acquires its
    pipeline's, which is not unloaded until released."""

    def acquire(self, name: str) -> Predictor:
        """Loaded now if it is not; ModelLoadFailed when it cannot be."""
        ...

    def release(self, name: str) -> None: ...

    def ready(self, name: str) -> bool: ...

    def load(self, name: str) -> None:
        """ModelLoadFailed when it cannot be loaded."""
        ...


class OneModel:
    """One predictor for every batch (a process serving one pipeline, and tests)."""

    def __init__(self, predictor: Predictor) -> None:
        self.predictor = predictor

    def acquire(self, name: str) -> Predictor:
        return self.predictor

    def release(self, name: str) -> None:
        pass

    def ready(self, name: str) -> bool:
        return True

    def load(self, name: str) -> None:
        pass


class Engine:
    """Owns the persistent loader and the models. ``run_batch`` is called on one thread only.

    Every batch is one pipeline's: its model is acquired for the batch and released after,
    images are loaded by that pipeline's decode plan (``plans``), and only images of the same
    pipeline are staged ahead while it runs."""

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
        self._pipeline_of: dict[int, str] = {}  # keys submitted and not yet run or forgotten
        self._pipeline = ""  # the batch running's
        self._predictor: Predictor | None = None  # its model, while it runs
        self.max_consecutive_failures = max_consecutive_failures
        self.consecutive_failures = 0
        self._heartbeat = heartbeat
        self._release_memory = release_memory
        self.out_of_memory = 0  # batches split for lack of device memory (a metric)
        self.read_retries: Counter[str] = Counter()  # by reason, since the start (a metric)
        self._reads: dict[int, ReadStats] = {}  # per loader child, as it last reported
        self._stash: dict[int, Loaded] = {}  # loaded, for a later batch
        self._copied_ahead: dict[int, Decoded] = {}  # of those, on their way to the device
        self._queued: dict[int, None] = {}  # keys submitted and not yet run, in order
        self._queued_lock = threading.Lock()  # submit runs on the event loop's thread
        self._loader_failed: str | None = None  # seen while preparing the next batch
        self.ran_copied_ahead = 0  # images that were on the device before their batch ran (bench)
        self._split_batch = False  # this batch ran out of device memory: nothing copied ahead
        self._prepared_s = 0.0  # spent preparing next batches, not in this one's inference

    def start(self) -> None:
        self.loader.start()

    def close(self) -> None:
        self.loader.close()
        self._stash.clear()
        self._copied_ahead.clear()

    def ready(self, pipeline: str) -> bool:
        return self.models.ready(pipeline)

    def load(self, pipeline: str) -> Failure | None:
        """Make ``pipeline``'s models resident (any thread); the failure its tasks get when
        they cannot be."""
        try:
            self.models.load(pipeline)
        except ModelLoadFailed as failed:
            return failed.failure
        return None

    def submit(self, requests: Sequence[tuple[int, str]], pipeline: str = "") -> None:
        """Queue loads of (key, URI) for ``pipeline``; any thread. Loader children start on
        them at once, decoding by that pipeline's plan."""
        plan = self._plans.get(pipeline)
        with self._queued_lock:
            self._queued.update((key, None) for key, _ in requests)
            self._pipeline_of.update((key, pipeline) for key, _ in requests)
        self.loader.submit([LoadRequest(key, uri, plan) for key, uri in requests])

    def forget(self, keys: Sequence[int]) -> None:
        """Drop loads that nobody will collect (tasks given back at shutdown, or failed)."""
        self._dequeue(keys)
        for key in keys:
            self._stash.pop(key, None)
            self._copied_ahead.pop(key, None)

    def _dequeue(self, keys: Sequence[int]) -> None:
        with self._queued_lock:
            for key in keys:
                self._queued.pop(key, None)
                self._pipeline_of.pop(key, None)

    def run_batch(self, keys: Sequence[int], pipeline: str = "") -> BatchReport:
        """One pipeline's batch: its model held for the batch, never unloaded meanwhile."""
        try:
            predictor = self.models.acquire(pipeline)  # loaded already, unless evicted since
        except ModelLoadFailed as failed:
            self.forget(keys)
            outcomes = {key: Outcome(failure=failed.failure) for key in keys}
            return BatchReport(outcomes, 0.0, 0.0, 0)
        self._pipeline, self._predictor = pipeline, predictor
        try:
            return self._run_batch(keys)
        finally:
            self._predictor = None
            self.models.release(pipeline)

    def _run_batch(self, keys: Sequence[int]) -> BatchReport:
        self._dequeue(keys)
        self._split_batch = False
        restarts_before = self.loader.restarts
        unhealthy = self.loader.unhealthy_children()
        if unhealthy:
            # A stopped or dead child that holds no request would never trip the timeout,
            # yet it is lost capacity (or a trap for the next request): replace it now.
            self._recover(set(), f"loader children unhealthy: {', '.join(unhealthy)}")
        started = time.perf_counter()
        loaded, failure = self._collect(keys)
        if failure is None:
            self.consecutive_failures = 0
        else:
            self.consecutive_failures += 1
            if self.consecutive_failures >= self.max_consecutive_failures:
                raise LoaderGaveUp(
                    f"the loader failed {self.consecutive_failures} times in a row; last: {failure}"
                )
        load_s = time.perf_counter() - started
        outcomes: dict[int, Outcome] = {}
        for key in keys:
            item = loaded.get(key)
            if item is None:
                lost = Failure("loader_failed", failure or "the loader lost it", retryable=True)
                outcomes[key] = Outcome(failure=lost)
            elif item.image is None:
                outcomes[key] = Outcome(failure=item.failure, timings_s={"load_s": item.load_s})
        ready = [key for key in keys if key not in outcomes]
        infer_started, prepared_s = time.perf_counter(), self._prepared_s
        outcomes.update(self._infer(ready, loaded))
        infer_s = time.perf_counter() - infer_started - (self._prepared_s - prepared_s)
        return BatchReport(outcomes, load_s, infer_s, self.loader.restarts - restarts_before)

    def _collect(self, keys: Sequence[int]) -> tuple[dict[int, Loaded], str | None]:
        wanted = set(keys)
        loaded = {key: self._stash.pop(key) for key in keys if key in self._stash}
        if self._loader_failed is not None:
            # It broke while the last batch ran: as if it broke now (what this batch still
            # needs is given back, so an image that kills children uses up its deliveries).
            failure, self._loader_failed = self._loader_failed, None
            self._recover(wanted, failure)
            return loaded, failure
        while len(loaded) < len(wanted):
            try:
                item = self.loader.next_loaded()
            except LoaderFailure as error:
                self._recover(wanted, str(error))
                return loaded, str(error)
            self._note_reads(item)
            if item.key in wanted:
                loaded[item.key] = item
            else:
                self._keep(item)
        return loaded, None

    def _keep(self, item: Loaded) -> None:
        """An image of a later batch, already here: kept for it, unless its task is gone
        (forgotten: given back, or failed with its pipeline's model), then dropped."""
        with self._queued_lock:
            wanted = item.key in self._pipeline_of
        if wanted:
            self._stash[item.key] = item

    def _note_reads(self, item: Loaded) -> None:
        self.read_retries.update(item.retries)
        if item.reads is not None:
            self._reads[item.reads.pid] = item.reads

    def reads(self) -> list[ReadStats]:
        """The current loader children's reads, as each last reported them; any thread."""
        children = set(self.loader.child_pids())
        return [stats for pid, stats in list(self._reads.items()) if pid in children]

    def _recover(self, wanted: set[int], reason: str) -> None:
        """Rebuild the loader; reload what later batches still need, the rest is given back."""
        started = time.perf_counter()
        self._loader_failed = None  # whatever broke it, this loader is the new one
        self._heartbeat()  # recovering is not being wedged: the watchdog gets a fresh window
        try:
            lost = self.loader.restart()
        except LoaderFailure as error:
            raise LoaderGaveUp(f"no working loader after: {reason}; {error}") from None
        self._heartbeat()
        again = [request for request in lost if request.key not in wanted]
        if again:
            self.loader.submit(again)
        log.warning(
            "loader_restarted",
            reason=reason,
            restart_s=round(time.perf_counter() - started, 3),
            given_back=len(lost) - len(again),
            reloading=len(again),
            child_pids=self.loader.child_pids(),
        )

    def _infer(self, keys: list[int], loaded: dict[int, Loaded]) -> dict[int, Outcome]:
        """The batch's forward pass; if it fails, each image alone, so one image that breaks
        the model (or its output) fails alone and its batch-mates keep their deliveries. Out of
        device memory, the batch is halved instead, down to one image (``_split``)."""
        if not keys:
            return {}
        out_of_memory = False
        try:
            return self._forward(keys, loaded)
        except Exception as error:  # noqa: BLE001 - the model is the user's code: a result each
            if is_out_of_memory(error):
                out_of_memory = True  # split outside this block: its traceback holds memory
            elif len(keys) == 1:
                return {keys[0]: _failed(error)}
            else:
                log.warning("batch_failed_trying_each_image", batch=len(keys), error=repr(error))
        if out_of_memory:
            return self._split(keys, loaded)
        outcomes: dict[int, Outcome] = {}
        for key in keys:
            outcomes.update(self._infer([key], loaded))
        return outcomes

    def _split(self, keys: list[int], loaded: dict[int, Loaded]) -> dict[int, Outcome]:
        """Out of device memory: trim the allocator's cache, then run each half on its own; an
        image that does not fit alone gets ``too_large_for_device``. The process keeps going."""
        self.out_of_memory += 1
        self._copied_ahead.clear()  # the next batch's images wait on the host until it runs
        self._split_batch = True
        self._release_memory()
        if len(keys) == 1:
            log.warning("image_too_large_for_device", key=keys[0])
            message = "out of device memory with this image alone (try a smaller MAX_SIDE)"
            # Retried on later deliveries (another process on the GPU may have held the
            # memory); the last one stores this error.
            failure = Failure("too_large_for_device", message, retryable=True)
            return {keys[0]: Outcome(failure=failure)}
        half = len(keys) // 2
        log.warning("out_of_device_memory_splitting_batch", batch=len(keys), into=half)
        return {**self._infer(keys[:half], loaded), **self._infer(keys[half:], loaded)}

    def _forward(self, keys: list[int], loaded: dict[int, Loaded]) -> dict[int, Outcome]:
        started = time.perf_counter()
        images = []
        for key in keys:
            ahead = self._copied_ahead.pop(
                key, None
            )  # forget() may pop it too, from another thread
            self.ran_copied_ahead += ahead is not None
            images.append(ahead if ahead is not None else loaded[key].image)
        prepared_s = self._prepared_s
        assert self._predictor is not None
        detections = self._predictor.run(images, self._prepare_next)  # type: ignore[arg-type]
        infer_s = time.perf_counter() - started - (self._prepared_s - prepared_s)
        return {
            key: Outcome(
                detections=found,
                timings_s={"load_s": loaded[key].load_s, "infer_s": infer_s / len(keys)},
            )
            for key, found in zip(keys, detections, strict=True)
        }

    def _prepare_next(self) -> None:
        """While the device runs this batch: take what the loader already has ready (not
        waiting for a child to finish a load), and start copying the first images of the
        next batch to the device, so it does not wait for them. Never fails the batch it runs
        in: a broken loader is recovered at the next batch, a failed copy is made again when
        its batch runs."""
        predictor = self._predictor
        if predictor is None or predictor.copy_ahead_images <= 0 or self._split_batch:
            return
        started = time.perf_counter()
        with self._queued_lock:  # the next images of this batch's pipeline (copied its way)
            same = (k for k in self._queued if self._pipeline_of.get(k) == self._pipeline)
            upcoming = list(itertools.islice(same, predictor.copy_ahead_images))
        try:
            self._take_ready(upcoming)
            for key in [key for key in list(self._copied_ahead) if key not in upcoming]:
                self._copied_ahead.pop(key, None)  # no longer next (forgotten): only those are held
            ready = {key: item.image for key in upcoming if (item := self._stash.get(key))}
            fresh = [
                key
                for key, image in ready.items()
                if image is not None and image.encoded is None and key not in self._copied_ahead
            ]  # a JPEG left encoded is decoded on the device when its batch runs
            if fresh:
                copies = predictor.copy_ahead([ready[key] for key in fresh])  # type: ignore[misc]
                self._copied_ahead.update(zip(fresh, copies, strict=True))
        except Exception as error:  # noqa: BLE001 - the next batch copies its images itself
            self._copied_ahead.clear()
            if is_out_of_memory(error):
                self._release_memory()
            log.warning("preparing_next_batch_failed", error=repr(error))
        finally:
            self._prepared_s += time.perf_counter() - started

    def _take_ready(self, upcoming: list[int]) -> None:
        """Move finished loads the loader holds into the stash, while some of ``upcoming``
        are missing; at most what it had outstanding."""
        if self._loader_failed is not None:
            return
        for _ in range(self.loader.outstanding()):
            if all(key in self._stash for key in upcoming) or not self.loader.ready():
                return
            try:
                item = self.loader.next_loaded()
            except LoaderFailure as error:
                self._loader_failed = str(error)  # recovered by the next batch's collect
                return
            self._note_reads(item)
            self._keep(item)


def _failed(error: Exception) -> Outcome:
    """A forward pass that raised: permanent when the pipeline says so (an output it cannot
    use for this image), else worth another delivery."""
    if isinstance(error, PermanentError):
        log.warning("inference_refused_image", error=str(error))
        return Outcome(failure=error.failure())
    log.error("inference_failed", error=repr(error), exc_info=error)
    message = f"inference failed: {type(error).__name__}: {error}"
    return Outcome(failure=Failure("inference_failed", message, retryable=True))
