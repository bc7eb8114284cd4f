"""One forward pass of a pipeline over a batch of decoded images, into Antenna-shaped
detections (``DetectionResponse`` without ``source_image_id``, which the result adds).

Memory: the detector sees ``detector_batch`` images at a time; crops are cut from the decoded
image and classified ``crop_batch`` at a time, never all at once (README, "Memory").
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import numpy as np
import torch

from config.errors import ConfigError, TransientError
from datasets.images import Decoded, DecodePlan, resize_square
from pipelines.declare import Pipeline
from pipelines.device import CopyStats, decode_on_device, to_device_overlapped
from pipelines.models import Algorithm, ClassifierModel, DetectorModel

Scores = Literal["all", "top_k"]


@dataclass(frozen=True)
class Output:
    """How classifications are written."""

    scores: Scores = "all"  # the full softmax vector (Antenna's default), or the top k
    top_k: int = 5
    labels_inline_max: int = 100  # longer class lists are published once, not per result
    detector_batch: int = 4
    crop_batch: int = 64
    max_side: int = 4096  # for JPEGs the loader left encoded (decoded on the device)


def _now() -> str:
    return datetime.now(UTC).isoformat()


def _rounded(values: torch.Tensor) -> list[float]:
    return [float(x) for x in np.round(values.numpy().astype(np.float64), 6)]


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
        output: Output,
    ) -> None:
        self.pipeline = pipeline
        self.detector = detector
        self.filter = filter
        self.classifier = classifier
        self.output = output
        self.copies = CopyStats()
        self.measure_copies = False  # bench.gpu: time the waits (the host then waits too)
        self._copy_stream: Any = None

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

    def algorithms(self) -> list[Algorithm]:
        return [m.algorithm for m in (self.detector, self.filter, self.classifier) if m]

    def run(self, images: Sequence[Decoded]) -> list[list[dict[str, Any]]]:
        """Per image, its detections (a classifier alone gives one with ``bbox: None``)."""
        if any(image.encoded is not None for image in images):
            where, side = self.device, self.output.max_side
            images = [
                decode_on_device(image, where, side) if image.encoded is not None else image
                for image in images
            ]
            if where.type == "cuda":  # PNGs came decoded: every image on one device
                images = [
                    image._replace(pixels=_tensor(image.pixels).to(where)) for image in images
                ]
        if self.detector is None:
            assert self.classifier is not None
            return self._classify_whole(images, self.classifier)
        return self._detect_and_classify(images, self.detector)

    def _classify_whole(
        self, images: Sequence[Decoded], classifier: ClassifierModel
    ) -> list[list[dict[str, Any]]]:
        pre = classifier.stage.preprocess
        step = self.output.crop_batch
        host = (
            torch.stack(
                [
                    resize_square(_tensor(image.pixels), pre.size, pre.resize)
                    for image in images[start : start + step]
                ]
            )
            for start in range(0, len(images), step)
        )
        started = time.perf_counter()
        parts = [
            classifier.logits(batch)
            for batch in to_device_overlapped(
                host, classifier.device, *self._copying(classifier.device)
            )
        ]
        logits = torch.cat(parts)
        each_s = (time.perf_counter() - started) / len(images)
        return [
            [
                {
                    "bbox": None,
                    "inference_time": round(each_s, 6),
                    "algorithm": classifier.algorithm.reference(),
                    "timestamp": _now(),
                    "crop_image_url": None,
                    "classifications": [self._classification(classifier, row, each_s, True)],
                }
            ]
            for row in logits
        ]

    def _detect_and_classify(
        self, images: Sequence[Decoded], detector: DetectorModel
    ) -> list[list[dict[str, Any]]]:
        results: list[list[dict[str, Any]]] = [[] for _ in images]
        crops: list[_Crop] = []
        step = self.output.detector_batch
        for start in range(0, len(images), step):
            chunk = images[start : start + step]
            started = time.perf_counter()
            found = detector.detect([_tensor(image.pixels) for image in chunk])
            each_s = (time.perf_counter() - started) / len(chunk)
            for offset, (image, boxes) in enumerate(zip(chunk, found, strict=True)):
                index = start + offset
                sx = image.source_width / image.pixels.shape[2]
                sy = image.source_height / image.pixels.shape[1]
                for box, score, label in zip(
                    boxes.boxes.tolist(), boxes.scores.tolist(), boxes.labels.tolist(), strict=True
                ):
                    x1, y1, x2, y2 = (float(v) for v in box)
                    detection: dict[str, Any] = {
                        "bbox": {
                            "x1": round(x1 * sx, 2),
                            "y1": round(y1 * sy, 2),
                            "x2": round(x2 * sx, 2),
                            "y2": round(y2 * sy, 2),
                        },
                        "inference_time": round(each_s, 6),
                        "algorithm": detector.algorithm.reference(),
                        "timestamp": _now(),
                        "crop_image_url": None,
                        "classifications": [],
                    }
                    if self.filter is None and self.classifier is None:
                        detection["classifications"].append(
                            self._detected(detector, int(label), float(score), each_s)
                        )
                    results[index].append(detection)
                    crops.append(_Crop(index, (x1, y1, x2, y2), detection["classifications"]))
        self._classify_crops(images, crops)
        return results

    def _classify_crops(
        self,
        images: Sequence[Decoded],
        crops: list[_Crop],
    ) -> None:
        """Filter then classifier over every crop, ``crop_batch`` crops in memory at a time."""
        passed = crops
        if self.filter is not None:
            keep = set(self.filter.stage.keep)
            terminal_alone = self.classifier is None
            passed = []
            for chunk, logits, each_s in self._chunks(images, crops, self.filter):
                labels = self.filter.algorithm.labels
                for crop, row in zip(chunk, logits, strict=True):
                    top = labels[int(row.argmax())]
                    goes_on = top in keep and not terminal_alone
                    entry = self._classification(self.filter, row, each_s, not goes_on)
                    crop.classifications.append(entry)
                    if goes_on:
                        passed.append(crop)
        if self.classifier is not None:
            for chunk, logits, each_s in self._chunks(images, passed, self.classifier):
                for crop, row in zip(chunk, logits, strict=True):
                    entry = self._classification(self.classifier, row, each_s, True)
                    crop.classifications.append(entry)

    def _chunks(
        self, images: Sequence[Decoded], crops: list[_Crop], model: ClassifierModel
    ) -> Iterator[tuple[list[_Crop], torch.Tensor, float]]:
        pre = model.stage.preprocess
        step = self.output.crop_batch
        chunks = [crops[start : start + step] for start in range(0, len(crops), step)]
        host = (
            torch.stack(
                [
                    resize_square(_cut(images[c.image].pixels, c.box), pre.size, pre.resize)
                    for c in chunk
                ]
            )
            for chunk in chunks
        )
        # On CUDA the next chunk is cut, pinned and copied while this one runs.
        moved = to_device_overlapped(host, model.device, *self._copying(model.device))
        for chunk, batch in zip(chunks, moved, strict=True):
            started = time.perf_counter()
            logits = model.logits(batch)
            yield chunk, logits, (time.perf_counter() - started) / len(chunk)

    @staticmethod
    def _detected(
        detector: DetectorModel, label: int, score: float, inference_s: float
    ) -> dict[str, Any]:
        """A detector alone: its class and score for the box, as the box's one classification."""
        return {
            "classification": detector.label(label),
            "labels": [detector.label(label)],
            "scores": [round(score, 6)],
            "logits": None,
            "inference_time": round(inference_s, 6),
            "algorithm": detector.algorithm.reference(),
            "terminal": True,
            "timestamp": _now(),
        }

    def _classification(
        self, model: ClassifierModel, logits: torch.Tensor, inference_s: float, terminal: bool
    ) -> dict[str, Any]:
        labels = model.algorithm.labels
        probs = torch.softmax(logits, dim=0)
        entry: dict[str, Any] = {"classification": labels[int(probs.argmax())]}
        if self.output.scores == "top_k":
            k = min(self.output.top_k, len(labels))
            scores, indices = probs.topk(k)
            entry["labels"] = [labels[i] for i in indices.tolist()]
            entry["scores"] = _rounded(scores)
            entry["logits"] = _rounded(logits[indices])
        else:
            if len(labels) <= self.output.labels_inline_max:
                entry["labels"] = list(labels)
            entry["scores"] = _rounded(probs)
            entry["logits"] = _rounded(logits)
        entry.update(
            inference_time=round(inference_s, 6),
            algorithm=model.algorithm.reference(),
            terminal=terminal,
            timestamp=_now(),
        )
        return entry


def _tensor(pixels: Any) -> torch.Tensor:
    """Pixels as a tensor: decoded on the device already, or a numpy array from the loader."""
    return pixels if isinstance(pixels, torch.Tensor) else torch.from_numpy(pixels)


def _cut(pixels: Any, box: tuple[float, float, float, float]) -> torch.Tensor:
    """The box's pixels (at least one), clamped to the image."""
    _, height, width = pixels.shape
    x1 = min(max(0, math.floor(box[0])), width - 1)
    y1 = min(max(0, math.floor(box[1])), height - 1)
    x2 = max(x1 + 1, min(width, math.ceil(box[2])))
    y2 = max(y1 + 1, min(height, math.ceil(box[3])))
    return _tensor(pixels)[:, y1:y2, x1:x2].contiguous()


def load_runner(
    pipeline: Pipeline, sources: Any, device: str, output: Output, precision: str = "float32"
) -> Runner:
    """Every stage of ``pipeline`` loaded on ``device`` (weights read once, here). ConfigError
    for anything that stops it loading, but a TransientError (its weights' store is down)."""
    from pipelines.models import resolve_device

    try:
        where = resolve_device(device)
        d, f, c = pipeline.detector, pipeline.filter, pipeline.classifier
        return Runner(
            pipeline,
            DetectorModel(d, sources, where, precision) if d else None,
            ClassifierModel(f, sources, where, precision) if f else None,
            ClassifierModel(c, sources, where, precision) if c else None,
            output,
        )
    except (ConfigError, TransientError):
        raise
    except Exception as error:  # noqa: BLE001 - weights, plugins and devices: all configuration
        raise ConfigError(
            f"pipeline {pipeline.name!r} cannot be loaded: {type(error).__name__}: {error}"
        ) from None


def decode_plan(
    pipeline: Pipeline, max_side: int, fast: bool, device_decode: bool = False
) -> DecodePlan:
    """What the loader children make of each image for this pipeline: the classifier's square
    input when there is no detector, else the image bounded by ``max_side`` (a JPEG left
    encoded for the device when ``device_decode``)."""
    if pipeline.detector is None and pipeline.classifier is not None:
        pre = pipeline.classifier.preprocess
        return DecodePlan(size=pre.size, resize=pre.resize, max_side=max_side, fast=fast)
    return DecodePlan(size=0, max_side=max_side, fast=fast, encoded=device_decode)
