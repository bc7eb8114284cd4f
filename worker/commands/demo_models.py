"""The demo's two small models of known behaviour, so its report can be read: a test detector
that boxes the bright rectangles of an image, and a colour classifier (the brightest channel
of its input wins). Neither has weights to download: each builds a complete model."""

from __future__ import annotations

import torch
from torch import nn

from pipelines.declare import Classifier, Detector, Pipeline, Preprocess

COLOURS = ("red", "green", "blue")
HALF = (0.5, 0.5, 0.5)


class BrightBoxesDetector(nn.Module):
    """A test detector with torchvision's detection interface: one box per bright rectangle
    (rectangles that do not share a column), score 1."""

    def forward(self, images: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        return [self._one(image) for image in images]

    @staticmethod
    def _one(image: torch.Tensor) -> dict[str, torch.Tensor]:
        mask = image.amax(dim=0) > 0.5
        columns = torch.nn.functional.pad(mask.any(dim=0).to(torch.int8), (1, 1))
        edges = torch.diff(columns).tolist()
        starts = [i for i, step in enumerate(edges) if step == 1]
        ends = [i for i, step in enumerate(edges) if step == -1]
        boxes = []
        for x1, x2 in zip(starts, ends, strict=True):
            rows = torch.nonzero(mask[:, x1:x2].any(dim=1)).flatten()
            boxes.append([float(x1), float(rows.min()), float(x2), float(rows.max() + 1)])
        count = len(boxes)
        return {
            "boxes": torch.tensor(boxes, dtype=torch.float32).reshape(count, 4),
            "scores": torch.ones(count),
            "labels": torch.ones(count, dtype=torch.int64),
        }


class ColourClassifier(nn.Module):
    """Logits from the mean of each channel; with its identity weights, red means red."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.head = nn.Linear(3, num_classes)
        with torch.no_grad():
            self.head.weight.copy_(torch.eye(num_classes, 3) * 10.0)
            self.head.bias.zero_()

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.head(batch.mean(dim=(2, 3)))


def _colour_stage() -> Classifier:
    return Classifier(
        key="colour-classifier",
        name="Colour classifier (demo)",
        architecture=ColourClassifier,
        labels=COLOURS,
        preprocess=Preprocess(size=32, resize="squash", mean=HALF, std=HALF),
    )


def colour_classifier() -> Pipeline:
    """The whole image's dominant colour."""
    return Pipeline("colours", description="demo: a colour classifier", classifier=_colour_stage())


def boxes_and_colours() -> Pipeline:
    """Each bright rectangle boxed, and its colour."""
    return Pipeline(
        "boxes-and-colours",
        description="demo: a test detector, then a colour classifier on each box",
        detector=Detector(
            key="bright-boxes",
            name="Bright-boxes test detector (demo)",
            architecture=lambda _classes: BrightBoxesDetector(),
            labels=("box",),
            score_threshold=0.5,
        ),
        classifier=_colour_stage(),
    )
