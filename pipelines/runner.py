"""One forward pass of a pipeline over a batch of decoded images, into Antenna-shaped
detections (``DetectionResponse`` without ``source_image_id``, which the result adds; the
shape itself is ``pipelines/response.py``'s).

Memory: the detector sees ``detector_batch`` images at a time; crops are cut from the decoded
image and classified ``crop_batch`` at a time, never all at once (docs/data-loading.md, "Memory").
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from config.errors import ConfigError, TransientError
from datasets.images import Decoded, DecodePlan, resize_square
from pipelines import response
from pipelines.declare import Pipeline, Preprocess
from pipelines.device import (
    CopyStats,
    InFlight,
    decode_on_device,
    to_device_overlapped,
    to_host,
)
from pipelines.device import copy_ahead as device_copy_ahead
from pipelines.files.fetch import ModelFiles
from pipelines.models import Algorithm, ClassifierModel, DetectorModel


@dataclass(frozen=True)
class DeviceLimits:
    """How much of a batch the device holds at once (docs/data-loading.md, "Memory")."""

    detector_batch: int = 4
    crop_batch: int = 64
    max_side: int = 4096  # for JPEGs the loader left encoded (decoded on the device)
    max_pixels: int = 0  # > 0: those JPEGs kept at full size (a full-size detector's plan)


class _Hook:
    """``Runner.run``'s ``while_running``: called once at most; each call says how long it
    took (0 after the first), so that time is not the model's."""

    def __init__(self, call: Callable[[], None]) -> None:
        self._call: Callable[[], None] | None = call

    def __call__(self) -> float:
        call, self._call = self._call, None
        if call is None:
            return 0.0
        started = time.perf_counter()
        call()
        return time.perf_counter() - started


@dataclass(frozen=True)
class _Crop:
    image: int  # index in the batch
    box: tuple[float, float, float, float]  # decoded pixels
    classifications: list[dict[str, Any]]  # its detection's, where the stages write


class Runner:
    """The loaded stages of one pipeline. Called on the engine thread only."""

    def __init__(
        self,
        pipeline: Pipeline,
        detector: DetectorModel | None,
        filter: ClassifierModel | None,
        classifier: ClassifierModel | None,
        limits: DeviceLimits,
        response_format: response.ResponseFormat,
    ) -> None:
        self.pipeline = pipeline
        self.detector = detector
        self.filter = filter
        self.classifier = classifier
        self.limits = limits
        self.response_format = response_format
        self.copies = CopyStats()
        self.measure_copies = False  # bench.gpu: time the waits (the host then waits too)
        self._copy_stream: Any = None
        # Called on the engine thread each time a chunk's forward pass is done (a detector
        # chunk's detections back on the host; a classifier chunk's pass run, on CUDA given
        # to the device with the one two before it done): the worker's liveness counts it as
        # progress, so a long batch that advances is no stall (docs/operating.md).
        self.progress: Callable[[], None] = _no_progress

    def _copying(self, device: torch.device) -> tuple[CopyStats | None, Any]:
        """What ``to_device_overlapped`` needs: the stats when measured, and this runner's one
        copy stream (made once: streams come from a pool, and freed blocks stay per stream)."""
        if device.type == "cuda" and self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device)
        return (self.copies if self.measure_copies else None), self._copy_stream

    @property
    def device(self) -> torch.device:
        """Where the stages run (all on one device)."""
        stages = [m for m in (self.detector, self.filter, self.classifier) if m is not None]
        return stages[0].device

    def weights_bytes(self) -> int:
        """Bytes of every stage's parameters and buffers, where they live (the memory budget's
        measure of this pipeline)."""
        return Runner.weights_bytes_together([self])

    @staticmethod
    def weights_bytes_together(runners: list[Runner]) -> int:
        """Bytes of several pipelines' stages at once: a stage they share counts once."""
        from pipelines.cache import tensor_bytes

        modules = [
            m.model for r in runners for m in (r.detector, r.filter, r.classifier) if m is not None
        ]
        return tensor_bytes(
            tensor for module in modules for tensor in (*module.parameters(), *module.buffers())
        )

    def algorithms(self) -> list[Algorithm]:
        return [m.algorithm for m in (self.detector, self.filter, self.classifier) if m]

    @property
    def copy_ahead_images(self) -> int:
        """Images of the next batch worth putting on the device while this one runs: its first
        chunk (later chunks are copied while earlier ones run, see ``to_device_overlapped``)."""
        return self.limits.detector_batch if self.detector else self.limits.crop_batch

    def copy_ahead(self, images: Sequence[Decoded]) -> list[Decoded]:
        """``images`` with their pixels on the device, copies started now on the copy stream
        (the host does not wait): called while the device still runs the current batch. JPEGs
        left encoded stay so; they are decoded when their batch runs. Off CUDA, the pixels
        are only made tensors."""
        where = self.device
        host = [i for i, image in enumerate(images) if image.encoded is None]
        pixels = [self._input(images[i]) for i in host]
        moved = device_copy_ahead(pixels, where, self._copying(where)[1]) if pixels else []
        copied = list(images)
        for i, tensor in zip(host, moved, strict=True):
            copied[i] = images[i]._replace(pixels=tensor)
        return copied

    def _input(self, image: Decoded) -> torch.Tensor:
        """What the first stage takes of an image: the classifier's square, or the image."""
        pixels = _tensor(image.pixels)
        if self.detector is None:
            assert self.classifier is not None
            pre = self.classifier.stage.preprocess
            return resize_square(pixels, pre.size, pre.resize)
        return pixels

    def run(
        self, images: Sequence[Decoded], while_running: Callable[[], None] = lambda: None
    ) -> list[list[dict[str, Any]]]:
        """Per image, its detections (a classifier alone gives one with ``bbox: None``).

        ``while_running`` is called once, after the last stage's work is given to the device
        and before its results are brought back: the engine prepares the next batch there
        while the device computes. Its time is not counted in ``inference_time``."""
        hook = _Hook(while_running)
        where = self.device
        if any(image.encoded is not None for image in images):
            side, pixels = self.limits.max_side, self.limits.max_pixels
            images = [
                decode_on_device(image, where, side, pixels) if image.encoded is not None else image
                for image in images
            ]
        if self.detector is None:
            assert self.classifier is not None
            results = self._classify_whole(images, self.classifier, hook)
        else:
            results = self._detect_and_classify(images, self.detector, hook)
        hook()  # called already, unless the batch was empty
        return results

    def _classify_whole(
        self, images: Sequence[Decoded], classifier: ClassifierModel, hook: _Hook
    ) -> list[list[dict[str, Any]]]:
        step = self.limits.crop_batch
        chunks = (
            [self._input(image) for image in images[start : start + step]]
            for start in range(0, len(images), step)
        )
        logits, each_s = self._logits(classifier, chunks, len(images), hook)
        return [
            [
                {
                    **response.detection(None, each_s, classifier.algorithm.reference(), (1, 1)),
                    "classifications": [self._classification(classifier, row, each_s, True)],
                }
            ]
            for row in logits
        ]

    def _logits(
        self,
        model: ClassifierModel,
        chunks: Iterable[list[torch.Tensor]],
        count: int,
        hook: _Hook | None,
    ) -> tuple[torch.Tensor, float]:
        """Logits of every chunk, on the host, and seconds of the stage per input. On CUDA the
        next chunk is cut, pinned and copied while this one runs; the host waits only to keep
        two chunks at most on the device, and for the logits, which come back in one copy
        (after ``hook``, when given)."""
        started = time.perf_counter()
        in_flight = InFlight(model.device)
        parts = []
        for chunk in to_device_overlapped(chunks, model.device, *self._copying(model.device)):
            parts.append(model.forward(torch.stack(chunk)))
            in_flight.launched()
            self.progress()
        logits = to_host(torch.cat(parts)) if parts else lambda: torch.zeros((0, 0))
        hook_s = hook() if hook is not None else 0.0
        return model.checked(logits()), (time.perf_counter() - started - hook_s) / max(1, count)

    def _detect_and_classify(
        self, images: Sequence[Decoded], detector: DetectorModel, hook: _Hook
    ) -> list[list[dict[str, Any]]]:
        results: list[list[dict[str, Any]]] = [[] for _ in images]
        crops: list[_Crop] = []
        seen: list[torch.Tensor] = []  # what the detector saw: crops are cut from it
        alone = self.filter is None and self.classifier is None
        step = self.limits.detector_batch
        starts = range(0, len(images), step)
        ends = [min(len(images), start + step) for start in starts]
        chunks = ([self._input(image) for image in images[s : s + step]] for s in starts)
        moved = to_device_overlapped(chunks, detector.device, *self._copying(detector.device))
        for start, end, inputs in zip(starts, ends, moved, strict=True):
            started = time.perf_counter()
            rows, counts = detector.rows(detector.forward(inputs))
            fetched = to_host(rows)
            hook_s = hook() if alone and end == len(images) else 0.0
            found = detector.cleaned(inputs, fetched(), counts)
            each_s = (time.perf_counter() - started - hook_s) / (end - start)
            self.progress()
            if not alone:  # on CUDA the images stay on the device until their crops are cut
                seen.extend(inputs)
            for index, boxes in zip(range(start, end), found, strict=True):
                image = images[index]
                sx = image.source_width / image.pixels.shape[2]
                sy = image.source_height / image.pixels.shape[1]
                for box, score, label in zip(
                    boxes.boxes.tolist(), boxes.scores.tolist(), boxes.labels.tolist(), strict=True
                ):
                    x1, y1, x2, y2 = (float(v) for v in box)
                    detection = response.detection(
                        (x1, y1, x2, y2), each_s, detector.algorithm.reference(), (sx, sy)
                    )
                    if alone:
                        detection["classifications"].append(
                            self._detected(detector, int(label), float(score), each_s)
                        )
                    results[index].append(detection)
                    crops.append(_Crop(index, (x1, y1, x2, y2), detection["classifications"]))
        if not alone:
            self._classify_crops(seen, crops, hook)
        return results

    def _classify_crops(self, seen: list[torch.Tensor], crops: list[_Crop], hook: _Hook) -> None:
        """Filter then classifier over every crop, ``crop_batch`` crops in memory at a time,
        cut from the images as the detector saw them (on CUDA: on the device, so an image
        gives the same crops whether it was copied ahead, decoded there, or copied with its
        batch)."""
        passed = crops
        if self.filter is not None:
            assert self.pipeline.filter is not None
            keep = set(self.pipeline.filter.keep)
            dropped_terminal = self.pipeline.filter.dropped_terminal
            terminal_alone = self.classifier is None
            passed = []
            logits, each_s = self._crop_logits(
                seen, crops, self.filter, hook if terminal_alone else None
            )
            labels = self.filter.algorithm.labels
            for crop, row in zip(crops, logits, strict=True):
                top = labels[int(row.argmax())]
                goes_on = top in keep and not terminal_alone
                terminal = terminal_alone or (not goes_on and dropped_terminal)
                entry = self._classification(self.filter, row, each_s, terminal)
                crop.classifications.append(entry)
                if goes_on:
                    passed.append(crop)
        if self.classifier is not None:
            logits, each_s = self._crop_logits(seen, passed, self.classifier, hook)
            for crop, row in zip(passed, logits, strict=True):
                entry = self._classification(self.classifier, row, each_s, True)
                crop.classifications.append(entry)

    def _crop_logits(
        self,
        seen: list[torch.Tensor],
        crops: list[_Crop],
        model: ClassifierModel,
        hook: _Hook | None,
    ) -> tuple[torch.Tensor, float]:
        pre = model.stage.preprocess
        step = self.limits.crop_batch
        chunks = (
            [_squared(_cut(seen[c.image], c.box), pre) for c in crops[start : start + step]]
            for start in range(0, len(crops), step)
        )
        return self._logits(model, chunks, len(crops), hook)

    @staticmethod
    def _detected(
        detector: DetectorModel, label: int, score: float, inference_s: float
    ) -> dict[str, Any]:
        reference = detector.algorithm.reference()
        return response.detector_classification(
            detector.label(label), score, inference_s, reference
        )

    def _classification(
        self, model: ClassifierModel, logits: torch.Tensor, inference_s: float, terminal: bool
    ) -> dict[str, Any]:
        labels, reference = model.algorithm.labels, model.algorithm.reference()
        return response.classification(
            self.response_format, labels, logits, inference_s, reference, terminal
        )


def _no_progress() -> None:
    pass


def _tensor(pixels: Any) -> torch.Tensor:
    """Pixels as a tensor: decoded on the device already, or a numpy array from the loader."""
    return pixels if isinstance(pixels, torch.Tensor) else torch.from_numpy(pixels)


def _squared(crop: torch.Tensor, pre: Preprocess) -> torch.Tensor:
    """A crop as the classifier takes it: uint8 resized (and rounded) by ``resize_square``, or,
    for ``resize_in="float"``, its float pixels (0..255) squashed to ``size`` x ``size`` by an
    antialiased bilinear resize, unrounded: torchvision's ``ToTensor()`` then
    ``Resize((size, size), antialias=True)``, scaled by 255 (the model's normalisation takes
    0..255), so equal to float rounding."""
    if pre.resize_in != "float":
        return resize_square(crop, pre.size, pre.resize)
    pixels = crop.float()
    if pixels.shape[-2:] == (pre.size, pre.size):
        return pixels
    return torch.nn.functional.interpolate(
        pixels[None],
        size=(pre.size, pre.size),
        mode="bilinear",
        align_corners=False,
        antialias=True,
    )[0]


def _cut(pixels: Any, box: tuple[float, float, float, float]) -> torch.Tensor:
    """The box's pixels (at least one), clamped to the image."""
    _, height, width = pixels.shape
    x1 = min(max(0, math.floor(box[0])), width - 1)
    y1 = min(max(0, math.floor(box[1])), height - 1)
    x2 = max(x1 + 1, min(width, math.ceil(box[2])))
    y2 = max(y1 + 1, min(height, math.ceil(box[3])))
    return _tensor(pixels)[:, y1:y2, x1:x2].contiguous()


def load_runner(
    pipeline: Pipeline,
    sources: Any,
    device: str,
    limits: DeviceLimits | None = None,
    response_format: response.ResponseFormat | None = None,
    precision: str = "float32",
    files: ModelFiles | None = None,
) -> Runner:
    """Every stage of ``pipeline`` loaded on ``device`` (weights read once, here, through
    ``files``, the host's model-file cache). ConfigError for anything that stops it loading,
    but a TransientError (its weights' store is down)."""
    from pipelines import shared
    from pipelines.models import resolve_device

    try:
        where = resolve_device(device)
        d, f, c = pipeline.detector, pipeline.filter, pipeline.classifier
        return Runner(
            pipeline,
            shared.detector(d, sources, where, precision, files) if d else None,
            shared.classifier(f, sources, where, precision, files) if f else None,
            shared.classifier(c, sources, where, precision, files) if c else None,
            limits or DeviceLimits(),
            response_format or response.ResponseFormat(),
        )
    except (ConfigError, TransientError):
        raise
    except Exception as error:  # noqa: BLE001 - weights, plugins and devices: all configuration
        raise ConfigError(
            f"pipeline {pipeline.name!r} cannot be loaded: {type(error).__name__}: {error}"
        ) from None


def decode_plan(
    pipeline: Pipeline,
    max_side: int,
    fast: bool,
    device_decode: bool = False,
    exact: bool = False,
    max_pixels: int = 0,
) -> DecodePlan:
    """What the loader children make of each image for this pipeline: the classifier's square
    input when there is no detector (by the fast, exact or default reduced path), else the
    image bounded by ``max_side``, or whole up to ``max_pixels`` for a ``full_size`` detector
    (a JPEG left encoded for the device when ``device_decode``)."""
    if pipeline.detector is None and pipeline.classifier is not None:
        pre = pipeline.classifier.preprocess
        return DecodePlan(
            size=pre.size, resize=pre.resize, max_side=max_side, fast=fast, exact=exact
        )
    whole = max_pixels if pipeline.detector is not None and pipeline.detector.full_size else 0
    return DecodePlan(size=0, max_side=max_side, max_pixels=whole, fast=fast, encoded=device_decode)
