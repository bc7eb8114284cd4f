"""The engine turns loader failures into retryable outcomes, and gives up after too many."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from config.errors import LoaderFailure, LoaderGaveUp, PermanentError
from datasets.images import Decoded, DecodePlan, decode
from datasets.loader import Loaded
from tests.fakes import FakePredictor
from worker.commands.demo_images import image_bytes
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


class Echo(FakePredictor):
    def run(self, images, while_running=None):
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


class RefusesImage(FakePredictor):
    """A pipeline whose output for image 3 is unusable, and which crashes on image 4."""

    def __init__(self):
        self.batches = []

    def run(self, images, while_running=None):
        keys = [int(image.pixels[0, 0, 0]) for image in images]
        self.batches.append(keys)
        if 3 in keys:
            raise PermanentError("non-finite logits for this image", kind="invalid_model_output")
        if 4 in keys:
            raise RuntimeError("CUDA error: invalid argument")  # one input's, not sticky
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


class ReadyLoader(FlakyLoader):
    """Says a result is ready while any is queued, unless ``slow`` (its children still at
    work); ``next_loaded`` fails when none is queued."""

    slow = False

    def ready(self):
        return bool(self.queue) and not self.failing and not self.slow

    def outstanding(self):
        return len(self.queue)


class CopiesAhead:
    """A device that records what it was given: images copied ahead (by key), and for each
    batch its keys, which of its images came copied ahead, and what was copied while it ran."""

    def __init__(self, copy_ahead_images=2, fail_copy_ahead=None):
        self.copy_ahead_images = copy_ahead_images
        self.fail_copy_ahead = fail_copy_ahead
        self.copied: dict[int, int] = {}  # id of the image copied ahead -> key
        self.runs = []

    def copy_ahead(self, images):
        if self.fail_copy_ahead is not None:
            raise self.fail_copy_ahead
        copies = [image._replace() for image in images]  # new objects, the same pixels
        self.copied.update({id(image): int(image.pixels[0, 0, 0]) for image in copies})
        return copies

    def run(self, images, while_running):
        keys = [int(image.pixels[0, 0, 0]) for image in images]
        came_copied_ahead = [self.copied.get(id(image)) for image in images]
        before = set(self.copied.values())
        while_running()
        during = sorted(set(self.copied.values()) - before)
        self.runs.append((keys, came_copied_ahead, during))
        return [[{"bbox": None, "classifications": []}] for _ in images]


def test_the_next_batchs_first_images_are_copied_ahead_while_this_batch_runs():
    loader, device = ReadyLoader(), CopiesAhead(copy_ahead_images=2)
    engine = Engine(loader, device)  # type: ignore[arg-type]
    submit(engine, [1, 2])
    submit(engine, [3, 4, 5])  # the next batches, already submitted

    assert engine.run_batch([1, 2]).outcomes[1].ok
    keys, came_copied_ahead, during = device.runs[-1]
    assert keys == [1, 2]
    assert came_copied_ahead == [None, None], "nothing ran before the first batch"
    assert during == [3, 4], "the next two, in order, taken from the loader as it runs"

    report = engine.run_batch([3, 4, 5])
    assert all(v.ok for v in report.outcomes.values())
    keys, came_copied_ahead, during = device.runs[-1]
    assert keys == [3, 4, 5]
    assert came_copied_ahead == [3, 4, None], "the images copied ahead are the ones that ran"
    assert during == []


def test_copying_ahead_never_waits_on_the_loader_and_forgotten_images_are_dropped():
    loader, device = ReadyLoader(), CopiesAhead(copy_ahead_images=4)
    engine = Engine(loader, device)  # type: ignore[arg-type]
    submit(engine, [1])
    submit(engine, [2])
    engine.stash.keep(loader.next_loaded())  # batch 1 is here; 2 is still being loaded
    loader.slow = True
    engine.run_batch([1])
    assert device.runs[-1][2] == [], "nothing was ready: nothing waited for"
    assert [request.key for request in loader.queue] == [2]

    loader.slow = False
    submit(engine, [3, 4])
    engine.run_batch([2])
    assert device.runs[-1][2] == [3, 4]
    engine.forget([3])  # given back at shutdown
    submit(engine, [5])
    engine.run_batch([4])
    assert device.runs[-1][1] == [4] and device.runs[-1][2] == [5]
    assert 3 not in engine.copy_ahead.copied_keys() and 3 not in engine.stash.loaded_keys()


def test_a_loader_that_breaks_while_a_batch_runs_is_recovered_by_the_next_batch():
    class BreaksOnSecondCall(ReadyLoader):
        calls = 0

        def next_loaded(self):
            self.calls += 1
            if self.calls == 2:  # the engine looking ahead, while batch 1 runs
                raise LoaderFailure("DataLoader worker (pid 7) is killed by signal: Killed")
            return super().next_loaded()

    loader, device = BreaksOnSecondCall(), CopiesAhead(copy_ahead_images=2)
    engine = Engine(loader, device)  # type: ignore[arg-type]
    submit(engine, [1])
    submit(engine, [2, 3])

    report = engine.run_batch([1])
    assert report.outcomes[1].ok, "the batch that ran is not failed by what broke after it"
    assert report.loader_restarts == 0 and loader.calls == 2

    report = engine.run_batch([2, 3])  # as if the loader broke while collecting them
    assert report.loader_restarts == 1
    failures = [v.failure for v in report.outcomes.values()]
    assert all(f is not None and f.kind == "loader_failed" and f.retryable for f in failures)
    assert engine.consecutive_failures == 1
    assert loader.calls == 2, "the broken loader was not asked again"


def test_a_loader_broken_while_a_batch_runs_and_seen_dead_at_the_next_is_rebuilt_once():
    class DiesWhilePolled(ReadyLoader):
        calls = 0
        dead = False

        def next_loaded(self):
            self.calls += 1
            if self.calls == 2:
                self.dead = True
                raise LoaderFailure("DataLoader worker (pid 7) is killed by signal: Killed")
            return super().next_loaded()

        def unhealthy_children(self):
            return ["7:gone"] if self.dead else []

        def restart(self):
            self.dead = False
            return super().restart()

    loader, device = DiesWhilePolled(), CopiesAhead(copy_ahead_images=2)
    engine = Engine(loader, device)  # type: ignore[arg-type]
    submit(engine, [1])
    submit(engine, [2, 3])
    assert engine.run_batch([1]).outcomes[1].ok

    report = engine.run_batch([2, 3])
    assert report.loader_restarts == 1, "one rebuild, before the batch: it reloads them"
    assert all(v.ok for v in report.outcomes.values())


def test_copying_ahead_that_runs_out_of_device_memory_fails_nothing_and_frees_the_cache():
    trims = []
    loader = ReadyLoader()
    device = CopiesAhead(fail_copy_ahead=torch.OutOfMemoryError("CUDA out of memory"))
    engine = Engine(loader, device, release_memory=lambda: trims.append(1))  # type: ignore[arg-type]
    submit(engine, [1])
    submit(engine, [2])
    assert engine.run_batch([1]).outcomes[1].ok
    assert trims == [1] and engine.copy_ahead.copied_keys() == []
    assert engine.run_batch([2]).outcomes[2].ok, "the image is copied when its batch runs"


def test_nothing_is_copied_ahead_while_a_batch_is_split_for_lack_of_device_memory():
    class OneAtATime(CopiesAhead):
        def run(self, images, while_running):
            if len(images) > 1:
                while_running()  # the next batch is copied ahead, then the results do not fit
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
            return super().run(images, while_running)

    loader, device = ReadyLoader(), OneAtATime(copy_ahead_images=2)
    engine = Engine(loader, device, release_memory=lambda: None)  # type: ignore[arg-type]
    submit(engine, [1, 2])
    submit(engine, [3, 4])
    assert all(v.ok for v in engine.run_batch([1, 2]).outcomes.values())
    assert [(run[0], run[2]) for run in device.runs] == [([1], []), ([2], [])]
    copied = engine.copy_ahead.copied_keys()
    assert copied == [], "what the whole batch copied ahead was let go for the halves"
    assert all(v.ok for v in engine.run_batch([3]).outcomes.values())
    assert engine.copy_ahead.copied_keys() == [4], "the next batch copies ahead again"


def test_an_image_loaded_for_a_forgotten_task_is_dropped_not_kept():
    loader = FlakyLoader()
    engine = Engine(loader, Echo())  # type: ignore[arg-type]
    submit(engine, [1, 2, 3])  # loaded in this order
    engine.forget([1])  # its task failed with its pipeline's model, say
    assert engine.run_batch([2]).outcomes[2].ok  # 1 arrives first, while collecting 2
    assert engine.stash.loaded_keys() == []
    assert engine.run_batch([3]).outcomes[3].ok


def test_each_batch_runs_on_its_own_pipelines_model_and_loads_by_its_plan():
    from datasets.images import DecodePlan
    from worker.engine.predictors import OneModel

    class Named(Echo):
        def __init__(self, name):
            self.name = name

        def run(self, images, while_running=None):
            return [[{"bbox": None, "by": self.name}] for _ in images]

    class Two:
        def __init__(self):
            self.models = {"a": Named("a"), "b": Named("b")}
            self.held: list[str] = []

        def acquire(self, name):
            self.held.append(name)
            return self.models[name]

        def release(self, name):
            self.held.remove(name)

        def ready(self, name):
            return True

        def load(self, name):
            pass

    plans = {"a": DecodePlan(size=32), "b": DecodePlan(size=0, max_side=640)}
    loader, models = FlakyLoader(), Two()
    engine = Engine(loader, models=models, plans=plans)  # type: ignore[arg-type]
    engine.submit([(1, "file:///1.jpg")], "a")
    engine.submit([(2, "file:///2.jpg")], "b")
    assert [request.plan for request in loader.queue] == [plans["a"], plans["b"]]
    first = engine.run_batch([1], "a").outcomes[1].detections
    second = engine.run_batch([2], "b").outcomes[2].detections
    assert first == [{"bbox": None, "by": "a"}] and second == [{"bbox": None, "by": "b"}]
    assert models.held == []  # released after each batch
    assert isinstance(Engine(loader, Echo()).models, OneModel)  # type: ignore[arg-type]


def test_a_corrupt_jpeg_left_encoded_fails_alone_as_a_corrupt_image():
    from worker.commands.demo_images import truncated_bytes
    from worker.engine import Engine

    broken = decode(truncated_bytes(640, 480), DecodePlan(max_side=800, encoded=True))
    good = decode(image_bytes(640, 480, seed=1), DecodePlan(max_side=800, encoded=True))
    assert broken.encoded is not None and good.encoded is not None

    class Handing(FlakyLoader):
        def next_loaded(self):
            from datasets.loader import Loaded

            request = self.queue.pop(0)
            return Loaded(request.key, broken if request.key == 1 else good, None, 0.0, 1)

    class Counting(FakePredictor):
        def run(self, images, while_running=None):
            from pipelines.device import decode_on_device

            for image in images:
                decode_on_device(image, torch.device("cpu"), 800)
            return [[] for _ in images]

    engine = Engine(Handing(), Counting())  # type: ignore[arg-type]
    submit(engine, [1, 2])
    outcomes = engine.run_batch([1, 2]).outcomes
    assert outcomes[2].ok
    assert outcomes[1].failure is not None and outcomes[1].failure.kind == "corrupt_image"
