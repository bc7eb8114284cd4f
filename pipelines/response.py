"""The wire shape of what a pipeline found: Antenna's ``DetectionResponse`` and
``ClassificationResponse`` dicts (``source_image_id`` is added by the result), written from
model outputs. The one module that knows those field names; a task source that posts them
elsewhere (Antenna's HTTP API) reuses it. Knows nothing of devices or batching.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import numpy as np
import torch

Scores = Literal["all", "top_k"]
Box = tuple[float, float, float, float]


@dataclass(frozen=True)
class ResponseFormat:
    """How classifications are written."""

    scores: Scores = "all"  # the full softmax vector (Antenna's default), or the top k
    top_k: int = 5
    labels_inline_max: int = 100  # longer class lists are published once, not per result


def now() -> str:
    return datetime.now(UTC).isoformat()


def rounded(values: torch.Tensor) -> list[float]:
    out: list[float] = np.round(values.numpy().astype(np.float64), 6).tolist()
    return out  # Python floats, as float() makes them, at a third of the time


def detection(
    bbox: Box | None, inference_s: float, algorithm: dict[str, Any], scale: tuple[float, float]
) -> dict[str, Any]:
    """One detection: ``bbox`` in the pixels the model saw, written in source pixels
    (``scale`` = source / seen, per axis); None for a classifier run on the whole image."""
    sx, sy = scale
    return {
        "bbox": None
        if bbox is None
        else {
            "x1": round(bbox[0] * sx, 2),
            "y1": round(bbox[1] * sy, 2),
            "x2": round(bbox[2] * sx, 2),
            "y2": round(bbox[3] * sy, 2),
        },
        "inference_time": round(inference_s, 6),
        "algorithm": algorithm,
        "timestamp": now(),
        "crop_image_url": None,
        "classifications": [],
    }


def detector_classification(
    label: str, score: float, inference_s: float, algorithm: dict[str, Any]
) -> dict[str, Any]:
    """A detector alone: its class and score for the box, as the box's one classification."""
    return {
        "classification": label,
        "labels": [label],
        "scores": [round(score, 6)],
        "logits": None,
        "inference_time": round(inference_s, 6),
        "algorithm": algorithm,
        "terminal": True,
        "timestamp": now(),
    }


def classification(
    fmt: ResponseFormat,
    labels: Sequence[str],
    logits: torch.Tensor,
    inference_s: float,
    algorithm: dict[str, Any],
    terminal: bool,
) -> dict[str, Any]:
    """A classifier's answer for one input, from its logits, in ``fmt``."""
    probs = torch.softmax(logits, dim=0)
    entry: dict[str, Any] = {"classification": labels[int(probs.argmax())]}
    if fmt.scores == "top_k":
        k = min(fmt.top_k, len(labels))
        scores, indices = probs.topk(k)
        entry["labels"] = [labels[i] for i in indices.tolist()]
        entry["scores"] = rounded(scores)
        entry["logits"] = rounded(logits[indices])
    else:
        if len(labels) <= fmt.labels_inline_max:
            entry["labels"] = list(labels)
        entry["scores"] = rounded(probs)
        entry["logits"] = rounded(logits)
    entry.update(
        inference_time=round(inference_s, 6),
        algorithm=algorithm,
        terminal=terminal,
        timestamp=now(),
    )
    return entry
