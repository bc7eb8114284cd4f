"""The engine turns loader failures into retryable outcomes, and gives up after too many."""

from __future__ import annotations

import numpy as np
import pytest

from config.errors import LoaderFailure, LoaderGaveUp, PermanentError
from datasets.images import Decoded
from datasets.loader import Loaded
from worker.engine import Engine


class FlakyLoader:
    """Fails every ``next_loaded`` while ``failing``; otherwise returns what was submitted."""

    def __init__(self):
        self.failing = False
        self.queue = []
        self.restarts = 0

    def submit(self, requests):
        self.queue.extend(requests)

    def next_loaded(self):
        if self.failing or not self.queue:
            raise LoaderFailure("DataLoader timed out after 1 seconds")
        request = self.queue.pop(0)
        pixels = np.full((3, 8, 8), request.key, dtype=np.uint8)  # the key, readable in the image
        return Loaded(request.key, Decoded(pixels, 8, 8), None, 0.0, 1)

    def restart(self):
        self.restarts += 1
        lost, self.queue = self.queue, []
        return lost

    def child_pids(self):
        return [1]

    def unhealthy_children(self):
        return []


class Echo:
    def run(self, images):
        return [[{"bbox": None, "classifications": []}] for _ in range(len(images))]


def submit(engine, keys):
    engine.submit([(key, f"file:///{key}.jpg") for key in keys])


def test_a_hung_loader_gives_the_batch_back_and_keeps_later_batches():
    loader = FlakyLoader()
    engine = Engine(loader, Echo(), max_consecutive_failures=3)  # type: ignore[arg-type]
    submit(engine, [1, 2])
    submit(engine, [3, 4])  # a later batch, already submitted
    loader.failing = True
    report = engine.run_batch([1, 2])
    assert report.loader_restarts == 1
    assert all(v.retryable and v.failure.kind == "loader_failed" for v in report.outcomes.values())
    loader.failing = False
    # The later batch's requests were lost with the old loader and submitted to the new one.
    assert [request.key for request in loader.queue] == [3, 4]
    assert all(v.ok for v in engine.run_batch([3, 4]).outcomes.values())
    assert loader.restarts == 1


def test_too_many_failures_in_a_row_end_the_process_but_a_good_batch_resets_the_count():
    loader = FlakyLoader()
    engine = Engine(loader, Echo(), max_consecutive_failures=2)  # type: ignore[arg-type]
    loader.failing = True
    submit(engine, [1])
    engine.run_batch([1])
    loader.failing = False
    submit(engine, [2])
    assert engine.run_batch([2]).outcomes[2].ok
    loader.failing = True
    submit(engine, [3])
    engine.run_batch([3])
    submit(engine, [4])
    with pytest.raises(LoaderGaveUp, match="2 times in a row"):
        engine.run_batch([4])


class RefusesImage:
    """A pipeline whose output for image 3 is unusable, and which crashes on image 4."""

    def __init__(self):
        self.batches = []

    def run(self, images):
        keys = [int(image.pixels[0, 0, 0]) for image in images]
        self.batches.append(keys)
        if 3 in keys:
            raise PermanentError("non-finite logits for this image", kind="invalid_model_output")
        if 4 in keys:
            raise RuntimeError("CUDA error: an illegal memory access")
        return [[{"bbox": None, "classifications": []}] for _ in images]


def test_an_image_that_breaks_the_model_fails_alone_and_its_batch_mates_get_results():
    loader, pipeline = FlakyLoader(), RefusesImage()
    engine = Engine(loader, pipeline)  # type: ignore[arg-type]
    submit(engine, [1, 2, 3, 4, 5])

    outcomes = engine.run_batch([1, 2, 3, 4, 5]).outcomes

    assert [key for key in outcomes if outcomes[key].ok] == [1, 2, 5]
    refused, crashed = outcomes[3].failure, outcomes[4].failure
    assert refused is not None and (refused.kind, refused.retryable) == (
        "invalid_model_output",
        False,
    )
    assert crashed is not None and (crashed.kind, crashed.retryable) == ("inference_failed", True)
    assert pipeline.batches[0] == [1, 2, 3, 4, 5] and sorted(pipeline.batches[1:]) == [
        [1],
        [2],
        [3],
        [4],
        [5],
    ]
