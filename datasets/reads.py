"""Several object reads in flight in one loader child, bounded by a count and by bytes.

A 24 MB object from S3 spends about 300 ms on the wire (first byte ~30 ms, ~90 MB/s per
connection) and 30-190 ms in the decoder: a child that reads one object at a time waits most
of its time. ``ReadPool`` runs ``reads`` reader threads in the child. Each takes a request from
the loader's request queue once one of the ``reads`` slots is free, reads the object, and
leaves its bytes for the child's main thread, which decodes them one at a time in the order
the reads complete (order does not matter to the worker). A slot is held from taking the
request until its image is decoded; the object's bytes are held against a ``ByteBudget`` from
the moment its size is known until then. So a child holds at most ``reads`` requests and
``max(budget, one object)`` encoded bytes, and decodes on one core as before.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from config.errors import Failure, TransientError, WorkerError
from config.names import env_name
from datasets.budget import ByteBudget, Reading

_POLL_S = 0.5


class HasUri(Protocol):
    @property
    def uri(self) -> str: ...


ReadFn = Callable[[str, Reading], bytes]


@dataclass
class Read:
    """One request's read: the bytes or the failure, and what it cost."""

    request: Any  # the loader's LoadRequest (anything with a ``uri``)
    data: bytes | None
    failure: Failure | None
    read_s: float
    held_bytes: int  # held against the budget until the image is decoded
    retries: tuple[str, ...]


@dataclass(frozen=True)
class ReadStats:
    """A child's reads when it hands an image over, for the main process's metrics."""

    pid: int
    in_flight: int  # requests taken and not yet handed over, this one excluded
    held_bytes: int  # encoded bytes held for them
    peak_bytes: int  # the most held at once since the child started


class ReaderFailed(RuntimeError):
    """A reader thread of a loader child could not go on; the child's stream ends with it."""


class ReadPool:
    """``reads`` reader threads over the request queue ``requests``; used in a loader child."""

    def __init__(self, requests: Any, read: ReadFn, reads: int, budget_bytes: int) -> None:
        self._requests = requests
        self._read = read
        self._slots = threading.BoundedSemaphore(max(1, reads))
        self._budget = ByteBudget(budget_bytes)
        self._done: queue.Queue[Read | ReaderFailed | None] = queue.Queue()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._threads = [
            threading.Thread(target=self._reader, name=f"read-{n}", daemon=True)
            for n in range(max(1, reads))
        ]

    def start(self) -> ReadPool:
        for thread in self._threads:
            thread.start()
        return self

    def close(self) -> None:
        """Stop taking requests; readers in the middle of an object are left to finish (they
        are daemon threads, bounded by the object's deadline)."""
        self._stop.set()

    def next_read(self) -> Read | None:
        """The next finished read, waiting as long as it takes; None at the end of requests.
        ReaderFailed when a reader thread could not go on (the request queue broke)."""
        while True:
            try:
                item = self._done.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if isinstance(item, ReaderFailed):
                raise item
            return item

    def finished(self, read: Read) -> ReadStats:
        """``read``'s image is decoded: free its slot and bytes; the child's reads now."""
        self._budget.give(read.held_bytes)
        read.data = None  # the bytes are the budget's no longer: let them go now
        with self._lock:
            self._in_flight -= 1
            stats = ReadStats(
                os.getpid(), self._in_flight, self._budget.held_bytes(), self._budget.peak_bytes
            )
        self._slots.release()
        return stats

    def _reader(self) -> None:
        """Take requests while slots are free. Whatever goes wrong, a request taken ends as a
        Read; a reader that cannot go on ends the stream, so the child fails loudly (the
        loader sees it and rebuilds) instead of waiting for reads that will never come."""
        try:
            while not self._stop.is_set():
                if not self._slots.acquire(timeout=_POLL_S):
                    continue
                try:
                    request = self._requests.get(timeout=_POLL_S)
                except queue.Empty:
                    self._slots.release()
                    continue
                if request is None:  # end of requests: the child's stream ends
                    break
                with self._lock:
                    self._in_flight += 1
                self._done.put(self._one(request))
        except BaseException as error:  # noqa: BLE001 - reported through the stream, below
            self._done.put(ReaderFailed(f"{type(error).__name__}: {error}"))
        else:
            if not self._stop.is_set():
                self._done.put(None)
        self._stop.set()

    def _one(self, request: HasUri) -> Read:
        started = time.perf_counter()
        held = 0

        def admit(size_bytes: int, wait_s: float) -> None:
            nonlocal held
            if size_bytes <= held:
                return
            if not self._budget.take(size_bytes - held, held, wait_s):
                raise TransientError(
                    "no room for the object's bytes within its deadline "
                    f"({env_name('loader', 'read_bytes_per_worker')})",
                    kind="deadline_exceeded",
                )
            held = size_bytes

        reading = Reading(admit=admit)
        data: bytes | None = None
        failure: Failure | None = None
        try:
            data = self._read(request.uri, reading)
        except WorkerError as error:
            failure = error.failure()
        except Exception as error:  # noqa: BLE001 - one bad object must not end a reader
            failure = Failure("load_failed", f"{type(error).__name__}: {error}")
        if data is not None and held > len(data):  # the size was a bound, not the size
            self._budget.give(held - len(data))
            held = len(data)
        elif data is None:
            self._budget.give(held)
            held = 0
        return Read(
            request, data, failure, time.perf_counter() - started, held, tuple(reading.retries)
        )
