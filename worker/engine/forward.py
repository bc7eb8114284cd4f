"""One forward pass of a batch's images on its pipeline's model, the next batch prepared
while the device computes; its inference time leaves that preparation out."""

from __future__ import annotations

import time
from collections.abc import Sequence

from datasets.loader import Loaded
from worker.core.outcome import Outcome
from worker.engine.copy_ahead import CopyAhead
from worker.engine.predictors import Predictor


class Forward:
    """A batch's: called with some of its keys (all, a half, one), each time one pass."""

    def __init__(
        self, predictor: Predictor, loaded: dict[int, Loaded], copy_ahead: CopyAhead
    ) -> None:
        self._predictor = predictor
        self._loaded = loaded
        self._copy_ahead = copy_ahead

    def __call__(self, keys: Sequence[int]) -> dict[int, Outcome]:
        started = time.perf_counter()
        images = [self._copy_ahead.image(key, self._loaded[key]) for key in keys]
        prepared_s = self._copy_ahead.prepared_s
        prepare_next = self._copy_ahead.prepare_next
        detections = self._predictor.run(images, prepare_next)  # type: ignore[arg-type]
        infer_s = time.perf_counter() - started - (self._copy_ahead.prepared_s - prepared_s)
        return {
            key: Outcome(
                detections=found,
                timings_s={"load_s": self._loaded[key].load_s, "infer_s": infer_s / len(keys)},
            )
            for key, found in zip(keys, detections, strict=True)
        }
