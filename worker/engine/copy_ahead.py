"""Copying ahead: while the device runs a batch, the first images of the next batch of the
same pipeline start on their way to the device, so that batch does not wait for them."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import structlog

from datasets.images import Decoded
from datasets.loader import Loaded
from pipelines.device import is_out_of_memory
from worker.engine.predictors import Predictor
from worker.engine.stash import Stash

log = structlog.get_logger(__name__)


class CopyAhead:
    """On the engine thread, but for ``forget``, which may run on any thread. ``prepared_s``
    adds up the time spent preparing next batches, which is no batch's inference."""

    def __init__(
        self,
        stash: Stash,
        take_ready: Callable[[list[int]], None],
        release_memory: Callable[[], None],
    ) -> None:
        self._stash = stash
        self._take_ready = take_ready
        self._release_memory = release_memory
        self._copied: dict[int, Decoded] = {}  # loaded images on their way to the device
        self._pipeline = ""  # the batch running's
        self._predictor: Predictor | None = None  # its model, while it runs
        self._paused = False  # this batch ran out of device memory: nothing copied ahead
        self.prepared_s = 0.0
        self.ran_copied_ahead = 0  # images that were on the device before their batch ran (bench)

    def begin(self, pipeline: str, predictor: Predictor) -> None:
        """A batch of ``pipeline`` runs on ``predictor``: the next of that pipeline are copied."""
        self._pipeline, self._predictor, self._paused = pipeline, predictor, False

    def end(self) -> None:
        self._predictor = None

    def pause(self) -> None:
        """Out of device memory: the next batch's images wait on the host until it runs."""
        self._copied.clear()
        self._paused = True

    def image(self, key: int, item: Loaded) -> Decoded | None:
        """``key``'s image for its batch: the copy on the device if it was sent ahead."""
        ahead = self._copied.pop(key, None)  # forget() may pop it too, from another thread
        self.ran_copied_ahead += ahead is not None
        return ahead if ahead is not None else item.image

    def copied_keys(self) -> list[int]:
        return list(self._copied)

    def forget(self, keys: Sequence[int]) -> None:
        for key in keys:
            self._copied.pop(key, None)

    def clear(self) -> None:
        self._copied.clear()

    def prepare_next(self) -> None:
        """While the device runs this batch: take what the loader already has ready (not
        waiting for a child to finish a load), and start copying the first images of the
        next batch to the device. Never fails the batch it runs in: a broken loader is
        recovered at the next batch, a failed copy is made again when its batch runs."""
        predictor = self._predictor
        if predictor is None or predictor.copy_ahead_images <= 0 or self._paused:
            return
        started = time.perf_counter()
        upcoming = self._stash.upcoming(self._pipeline, predictor.copy_ahead_images)
        try:
            self._take_ready(upcoming)
            self._copy(predictor, upcoming)
        except Exception as error:  # noqa: BLE001 - the next batch copies its images itself
            self._copied.clear()
            if is_out_of_memory(error):
                self._release_memory()
            log.warning("preparing_next_batch_failed", error=repr(error))
        finally:
            self.prepared_s += time.perf_counter() - started

    def _copy(self, predictor: Predictor, upcoming: list[int]) -> None:
        for key in [key for key in list(self._copied) if key not in upcoming]:
            self._copied.pop(key, None)  # no longer next (forgotten): only those are held
        ready = {key: item.image for key in upcoming if (item := self._stash.loaded(key))}
        fresh = [
            key
            for key, image in ready.items()
            if image is not None and image.encoded is None and key not in self._copied
        ]  # a JPEG left encoded is decoded on the device when its batch runs
        if fresh:
            copies = predictor.copy_ahead([ready[key] for key in fresh])  # type: ignore[misc]
            self._copied.update(zip(fresh, copies, strict=True))
