"""The loads submitted and not yet run, in order and by pipeline, and those of them already
loaded, kept by key until their batch runs."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Sequence

from datasets.loader import Loaded


class Stash:
    """``submit`` and ``forget`` run on any thread (``submit`` on the event loop's); the rest
    on the engine thread."""

    def __init__(self) -> None:
        self._pipeline_of: dict[int, str] = {}  # keys submitted and not yet run or forgotten
        self._queued: dict[int, None] = {}  # keys submitted and not yet run, in order
        self._lock = threading.Lock()  # over both
        self._loaded: dict[int, Loaded] = {}  # loaded, for a later batch

    def submit(self, keys: Iterable[int], pipeline: str) -> None:
        with self._lock:
            for key in keys:
                self._queued[key] = None
                self._pipeline_of[key] = pipeline

    def dequeue(self, keys: Sequence[int]) -> None:
        """``keys`` run now: no longer queued (what is loaded of them is still taken)."""
        with self._lock:
            for key in keys:
                self._queued.pop(key, None)
                self._pipeline_of.pop(key, None)

    def forget(self, keys: Sequence[int]) -> None:
        """Nobody will collect ``keys``: dequeued, and dropped if loaded."""
        self.dequeue(keys)
        for key in keys:
            self._loaded.pop(key, None)

    def keep(self, item: Loaded) -> None:
        """An image of a later batch, already here: kept for it, unless its task is gone
        (forgotten: given back, or failed with its pipeline's model), then dropped."""
        with self._lock:
            wanted = item.key in self._pipeline_of
        if wanted:
            self._loaded[item.key] = item

    def take(self, keys: Iterable[int]) -> dict[int, Loaded]:
        """Those of ``keys`` already loaded, no longer kept here."""
        return {key: self._loaded.pop(key) for key in keys if key in self._loaded}

    def loaded(self, key: int) -> Loaded | None:
        return self._loaded.get(key)

    def holds(self, keys: Iterable[int]) -> bool:
        """Every one of ``keys`` is loaded."""
        return all(key in self._loaded for key in keys)

    def upcoming(self, pipeline: str, count: int) -> list[int]:
        """The first ``count`` keys queued for ``pipeline``, in the order submitted."""
        with self._lock:
            same = (k for k in self._queued if self._pipeline_of.get(k) == pipeline)
            return list(itertools.islice(same, count))

    def loaded_keys(self) -> list[int]:
        return list(self._loaded)

    def clear(self) -> None:
        """Drop what is loaded (the loader is closing)."""
        self._loaded.clear()
