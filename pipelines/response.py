"""What a pipeline found, written from model outputs: the typed ``pipelines.found``
detections and classifications, rounded as results carry them, in the ``ResponseFormat`` the
settings ask. Knows nothing of devices, batching or any source's result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

import numpy as np
import torch

from pipelines.found import Box, Classification, Detection, Ref

Scores = Literal["all", "top_k"]


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
    bbox: tuple[float, float, float, float] | None,
    inference_s: float,
    algorithm: Ref,
    scale: tuple[float, float],
) -> Detection:
    """One detection: ``bbox`` in the pixels the model saw, written in source pixels
    (``scale`` = source / seen, per axis); None for a classifier run on the whole image."""
    sx, sy = scale
    box = None
    if bbox is not None:
        box = Box(
            round(bbox[0] * sx, 2),
            round(bbox[1] * sy, 2),
            round(bbox[2] * sx, 2),
            round(bbox[3] * sy, 2),
        )
    return Detection(box, round(inference_s, 6), algorithm, now())


def detector_classification(
    label: str, score: float, inference_s: float, algorithm: Ref
) -> Classification:
    """A detector alone: its class and score for the box, as the box's one classification."""
    return Classification(
        label, [label], [round(score, 6)], None, round(inference_s, 6), algorithm, True, now()
    )


def classification(
    fmt: ResponseFormat,
    labels: Sequence[str],
    logits: torch.Tensor,
    inference_s: float,
    algorithm: Ref,
    terminal: bool,
) -> Classification:
    """A classifier's answer for one input, from its logits, in ``fmt``."""
    probs = torch.softmax(logits, dim=0)
    top = labels[int(probs.argmax())]
    written: list[str] | None
    if fmt.scores == "top_k":
        k = min(fmt.top_k, len(labels))
        scores, indices = probs.topk(k)
        written = [labels[i] for i in indices.tolist()]
        values, raw = rounded(scores), rounded(logits[indices])
    else:
        written = list(labels) if len(labels) <= fmt.labels_inline_max else None
        values, raw = rounded(probs), rounded(logits)
    return Classification(
        top, written, values, raw, round(inference_s, 6), algorithm, terminal, now()
    )
