"""What a pipeline found, typed, from the runner to each source's renderer: ``Detection`` and
``Classification``, their values as results carry them (boxes in source pixels to 2 decimals,
scores, logits and times to 6). Their fields are those of Antenna's ``DetectionResponse`` and
``ClassificationResponse``, the detection shape of both sources' results (SPEC.md); the
functions below write that shape, once, and each source's renderer builds its own result
around it (``worker.nats.render``, ``worker.antenna.render``). Imports nothing; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Ref:
    """The stage that made a detection or classification (Antenna's ``AlgorithmReference``),
    by its stage key."""

    name: str
    key: str


@dataclass(frozen=True, slots=True)
class Box:
    """A box in source pixels."""

    x1: float
    y1: float
    x2: float
    y2: float


@dataclass(frozen=True, slots=True)
class Classification:
    """One stage's answer for a box (or the whole image)."""

    classification: str  # the top label
    labels: list[str] | None  # None: not written (a class list longer than labels_inline_max)
    scores: list[float]
    logits: list[float] | None  # None for a detector's own label
    inference_time: float  # seconds, per input
    algorithm: Ref
    terminal: bool
    timestamp: str  # ISO 8601, UTC


@dataclass(frozen=True, slots=True)
class Detection:
    """A box (None: a classifier run on the whole image) and its classifications, in the order
    the stages wrote them (the runner appends to ``classifications``)."""

    bbox: Box | None
    inference_time: float  # seconds, per image
    algorithm: Ref
    timestamp: str
    classifications: list[Classification] = field(default_factory=list)


# -- the wire shape: Antenna's DetectionResponse / ClassificationResponse, as dicts ---------------
def reference(algorithm: Ref, key: str | None = None) -> dict[str, str]:
    """``algorithm`` as results name it, under ``key`` when given (a source's own key)."""
    return {"name": algorithm.name, "key": algorithm.key if key is None else key}


def head_fields(c: Classification) -> dict[str, Any]:
    """A classification's fields before its vectors (``scores``, ``logits``)."""
    if c.labels is None:
        return {"classification": c.classification}
    return {"classification": c.classification, "labels": c.labels}


def tail_fields(c: Classification, key: str | None = None) -> dict[str, Any]:
    """A classification's fields after its vectors, its stage under ``key`` when given."""
    return {
        "inference_time": c.inference_time,
        "algorithm": reference(c.algorithm, key),
        "terminal": c.terminal,
        "timestamp": c.timestamp,
    }


def classification_fields(c: Classification, key: str | None = None) -> dict[str, Any]:
    """``c`` as a ``ClassificationResponse``."""
    return {**head_fields(c), "scores": c.scores, "logits": c.logits, **tail_fields(c, key)}


def detection_head(d: Detection, image_id: str, key: str | None = None) -> dict[str, Any]:
    """A ``DetectionResponse``'s fields but its ``classifications`` (which come last)."""
    box = d.bbox
    return {
        "source_image_id": image_id,
        "bbox": None if box is None else {"x1": box.x1, "y1": box.y1, "x2": box.x2, "y2": box.y2},
        "inference_time": d.inference_time,
        "algorithm": reference(d.algorithm, key),
        "timestamp": d.timestamp,
        "crop_image_url": None,
    }


def fields(d: Detection, image_id: str) -> dict[str, Any]:
    """``d`` as a ``DetectionResponse`` for image ``image_id``, under our stage keys."""
    return {
        **detection_head(d, image_id),
        "classifications": [classification_fields(c) for c in d.classifications],
    }
