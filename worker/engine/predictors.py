"""What a batch runs on: a pipeline's forward pass (``Predictor``), the pipelines' models on
demand (``Models``), or one predictor for every batch (``OneModel``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from datasets.images import Decoded
from pipelines.found import Detection


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
    ) -> list[list[Detection]]:
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
