"""Models on demand: the pipelines a process serves, loaded when a batch needs them and kept
in an LRU cache bounded by a memory budget (bytes of the models' weights on their device).

The least recently used pipeline that no batch is using is unloaded when another needs the
room, or after ``idle_unload_s`` without a batch; a pipeline in use is never unloaded. A
pipeline larger than the whole budget is refused at start (``estimated_bytes``), or, when only
its load shows it, its load fails (``model_too_large``). Loads are serialised by a lock of their
own, and the cache's state by another, held only for moments: a batch acquiring a loaded model
never waits for another pipeline's load (a download can take minutes). A pipeline's files are
fetched (``prefetch``) before its load takes the load lock, so a slow or failing download of one
pipeline holds up no other's load; a pipeline whose last load failed makes room only once its
model is built, so a retry that fails again unloads nothing. The caller decides on
which thread loads run (the worker: a thread of their own, never the event loop). A failed load
raises ``ModelLoadFailed`` each time it is tried, its ``Failure.reason`` saying why
(``config.errors.LOAD_REASONS``); when to try again is the caller's (``worker.core.availability``).
With ``together`` (the bytes of several models at once), what models share (one stage in several
pipelines, ``pipelines/shared.py``) counts once against the budget.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import structlog

from config.errors import ConfigError, Failure, ModelLoadFailed, WorkerError
from config.names import env_name

log = structlog.get_logger(__name__)
M = TypeVar("M")
# The kinds of a model file's download that its file host refused or could not answer.
_DOWNLOAD_KINDS = frozenset(
    {
        "access_denied",
        "object_missing",
        "http_error",
        "s3_error",
        "redirect_refused",
        "address_refused",
        "tls_error",
        "http_unavailable",
        "s3_unavailable",
    }
)


@dataclass
class _Entry(Generic[M]):
    model: M
    bytes: int
    used_at: float
    in_use: int = 0


@dataclass
class CacheStats:
    """What the metrics read: counts since the start, and what is resident now."""

    loads: dict[str, int] = field(default_factory=dict)
    load_failures: dict[str, int] = field(default_factory=dict)
    evictions: dict[str, int] = field(default_factory=dict)
    load_seconds: dict[str, float] = field(default_factory=dict)


class ModelCache(Generic[M]):
    def __init__(
        self,
        load: Callable[[str], M],
        size_of: Callable[[M], int],
        budget_bytes: int,
        *,
        estimated_bytes: dict[str, int] | None = None,
        unloaded: Callable[[str], None] = lambda _name: None,
        clock: Callable[[], float] = time.monotonic,
        together: Callable[[list[M]], int] | None = None,
        prefetch: Callable[[str], None] = lambda _name: None,
    ) -> None:
        self._load = load
        self._prefetch = prefetch  # the pipeline's files into the host's cache, no model built
        self._failing: set[str] = set()  # whose last load failed: no room made before the next
        self._size_of = size_of
        self._together = together
        self.budget_bytes = budget_bytes
        self._estimated = dict(estimated_bytes or {})
        self._unloaded = unloaded  # after a model's last reference is dropped (CUDA: trim)
        self._clock = clock
        self._lock = threading.RLock()  # the state below, held for moments only
        self._loading = threading.Lock()  # one load at a time, the state's lock not held
        self._resident: OrderedDict[str, _Entry[M]] = OrderedDict()  # least recent first
        self.stats = CacheStats()

    # -- what is there ------------------------------------------------------------------
    def resident(self) -> dict[str, int]:
        """Bytes of each loaded pipeline, least recently used first."""
        with self._lock:
            return {name: entry.bytes for name, entry in self._resident.items()}

    def ready(self, name: str) -> bool:
        with self._lock:
            return name in self._resident

    def peek(self, name: str) -> M | None:
        """The loaded model, if it is; does not count as a use."""
        with self._lock:
            entry = self._resident.get(name)
            return entry.model if entry is not None else None

    # -- a batch's use --------------------------------------------------------------------
    def acquire(self, name: str) -> M:
        """The model for a batch (loaded now if it is not); unloaded by nobody until
        ``release``. ModelLoadFailed when it cannot be had."""
        while True:
            with self._lock:
                entry = self._resident.get(name)
                if entry is not None:
                    entry.in_use += 1
                    entry.used_at = self._clock()
                    self._resident.move_to_end(name)
                    return entry.model
            self.load(name)  # then taken above, unless unloaded meanwhile for room

    def release(self, name: str) -> None:
        with self._lock:
            entry = self._resident.get(name)
            if entry is not None:
                entry.in_use = max(0, entry.in_use - 1)
                entry.used_at = self._clock()

    def load(self, name: str) -> None:
        """Make ``name`` resident (a no-op when it is); ModelLoadFailed when it cannot be.
        Its files are fetched first, outside the load lock (a slow or refused download holds
        up no other pipeline's load); room is made before the build only for a pipeline whose
        last load did not fail (a retry that fails again evicts nothing), and in any case
        once its model is built (``_admit``)."""
        if self.ready(name):
            return
        started = time.perf_counter()
        try:
            self._prefetch(name)
        except Exception as error:  # noqa: BLE001 - the file host, the cache directory
            raise self._failed(name, error) from None
        with self._loading:
            with self._lock:
                if name in self._resident:
                    self._resident.move_to_end(name)
                    return
                if name not in self._failing:
                    self._make_room(name, self._estimated.get(name, 0))
            try:
                model = self._load(name)
            except Exception as error:  # noqa: BLE001 - the pipeline's code and weights, the host
                raise self._failed(name, error) from None
            with self._lock:
                self._failing.discard(name)
                self._admit(name, model, time.perf_counter() - started)

    def _failed(self, name: str, error: Exception) -> ModelLoadFailed:
        failure = _load_failure(name, error)
        with self._lock:
            self._failing.add(name)
            self.stats.load_failures[name] = self.stats.load_failures.get(name, 0) + 1
        log.error("model_load_failed", pipeline=name, error=failure.message)
        return ModelLoadFailed(failure, error)

    def unload_idle(self, idle_s: float) -> list[str]:
        """Unload every pipeline not used for ``idle_s`` (none in use); their names."""
        now = self._clock()
        with self._lock:
            idle = [
                name
                for name, entry in self._resident.items()
                if entry.in_use == 0 and now - entry.used_at >= idle_s
            ]
            for name in idle:
                self._evict(name, "idle")
            return idle

    def close(self) -> None:
        with self._lock:
            for name in list(self._resident):
                self._evict(name, "closing", counted=False)

    # -- inside the lock ------------------------------------------------------------------
    def _admit(self, name: str, model: M, seconds: float) -> None:
        """``model``, just loaded, made resident, unloading others for its room; over the
        whole budget, dropped (ModelLoadFailed, ``over_budget``)."""
        size = self._size_of(model)
        self._estimated[name] = size  # the measured size is the one to make room for next time
        if size > self.budget_bytes:
            del model
            self._unloaded(name)
            self.stats.load_failures[name] = self.stats.load_failures.get(name, 0) + 1
            failure = Failure(
                "model_too_large",
                f"pipeline {name!r} takes {size} bytes loaded, over the memory budget "
                f"({env_name('model', 'memory_budget_bytes')}={self.budget_bytes})",
                reason="over_budget",
            )
            log.error("model_load_failed", pipeline=name, error=failure.message)
            raise ModelLoadFailed(failure)
        self._make_room(name, size, model)
        self._resident[name] = _Entry(model, size, self._clock())
        self.stats.loads[name] = self.stats.loads.get(name, 0) + 1
        self.stats.load_seconds[name] = self.stats.load_seconds.get(name, 0.0) + seconds
        log.info(
            "model_loaded",
            pipeline=name,
            bytes=size,
            load_s=round(seconds, 3),
            resident=list(self._resident),
        )

    def _make_room(self, name: str, needed: int, model: M | None = None) -> None:
        """Unload least recently used idle pipelines until ``needed`` more bytes fit (or,
        given the loaded ``model``, until it fits beside them: what it shares with them is
        not counted twice)."""
        for other in list(self._resident):
            if self._used_bytes(needed, model) <= self.budget_bytes:
                return
            if other != name and self._resident[other].in_use == 0:
                self._evict(other, f"room for {name}")

    def _used_bytes(self, needed: int = 0, model: M | None = None) -> int:
        if self._together is None:
            return sum(entry.bytes for entry in self._resident.values()) + needed
        models = [entry.model for entry in self._resident.values()]
        return self._together(models + ([model] if model is not None else [])) + (
            0 if model is not None else needed
        )

    def _evict(self, name: str, reason: str, *, counted: bool = True) -> None:
        size = self._resident.pop(name).bytes  # the cache's reference, the last one
        self._unloaded(name)
        if counted:
            self.stats.evictions[name] = self.stats.evictions.get(name, 0) + 1
        log.info("model_unloaded", pipeline=name, bytes=size, reason=reason)


def _load_failure(name: str, error: Exception) -> Failure:
    """What a failed load makes of its pipeline: unavailable on this host, for a reason of the
    host or of the file host (``load_reason``); never its tasks' fault."""
    message = f"pipeline {name!r} could not be loaded: {error}"
    return Failure("model_load_failed", message, reason=load_reason(error))


def load_reason(error: BaseException) -> str:
    """Why a load failed, as one of ``config.errors.LOAD_REASONS``: the first error in its
    chain (what the load wrapped it in, then what it wrapped) that says."""
    cache = env_name("model", "cache_dir")
    seen: BaseException | None = error
    for _ in range(8):  # a chain is short; a cycle is not followed for ever
        if seen is None:
            break
        if isinstance(seen, WorkerError) and seen.kind in _DOWNLOAD_KINDS:
            return "download_refused"
        if isinstance(seen, WorkerError | OSError) and str(seen).startswith(cache):
            return "cache_unwritable"
        if isinstance(seen, ConfigError) and "cannot write model files" in str(seen):
            return "cache_unwritable"
        seen = seen.__cause__ or seen.__context__
    return "load_failed"


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (weights shared between modules are
    counted once)."""
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total
