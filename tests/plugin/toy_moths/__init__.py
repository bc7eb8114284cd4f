"""A plugin of known behaviour, so results can be checked against the images' content.

``moths``: a detector that boxes the bright rectangles of an image (rectangles that do not
share a column), a colour filter that keeps red and green crops, and a colour classifier.
The colour models read their weights (a ``state_dict``) from ``$TOY_MOTHS_WEIGHTS``.

``many``: 500 boxes on a grid and a 1,000-class classifier, for results too large for a message.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from pipelines.declare import Classifier, Detector, Pipeline, Preprocess

HALF = (0.5, 0.5, 0.5)
COLOURS = ("red", "green", "blue")


class BrightBoxes(nn.Module):
    """torchvision's detection interface: float (3, H, W) images in [0, 1] to boxes."""

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


class Grid(nn.Module):
    """``count`` boxes on a grid over each image, scores just over 0.9."""

    def __init__(self, count: int = 500) -> None:
        super().__init__()
        self.count = count

    def forward(self, images: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        found = []
        for image in images:
            _, height, width = image.shape
            side = 25
            cells = [(i % side, i // side) for i in range(self.count)]
            w, h = width / side, height / (self.count // side + 1)
            boxes = torch.tensor([[x * w, y * h, (x + 1) * w, (y + 1) * h] for x, y in cells])
            found.append(
                {
                    "boxes": boxes,
                    "scores": torch.full((self.count,), 0.95),
                    "labels": torch.ones(self.count, dtype=torch.int64),
                }
            )
        return found


class ColourClassifier(nn.Module):
    """Logits from the mean of each channel: with an identity weight, the brightest channel wins."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.head = nn.Linear(3, num_classes)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.head(batch.mean(dim=(2, 3)))


def seeded_classifier(num_classes: int) -> nn.Module:
    torch.manual_seed(0)
    return ColourClassifier(num_classes)


def colour_weights(path: str) -> str:
    """Write the colour models' weights (identity, so red means red) and return the path."""
    model = ColourClassifier(3)
    with torch.no_grad():
        model.head.weight.copy_(torch.eye(3) * 10.0)
        model.head.bias.zero_()
    torch.save(model.state_dict(), path)
    return path


def moths() -> Pipeline:
    weights = os.environ["TOY_MOTHS_WEIGHTS"]
    colour = Preprocess(size=32, resize="squash", mean=HALF, std=HALF)
    return Pipeline(
        name="toy-moths",
        detector=Detector(
            key="bright-boxes",
            name="Bright boxes",
            architecture=lambda _classes: BrightBoxes(),
            labels=("thing",),
            score_threshold=0.5,
        ),
        filter=Classifier(
            key="colour-filter",
            name="Colour filter",
            architecture=ColourClassifier,
            weights=weights,
            labels=COLOURS,
            preprocess=colour,
            keep=("red", "green"),
        ),
        classifier=Classifier(
            key="colour",
            name="Colour",
            architecture=ColourClassifier,
            weights=weights,
            labels=("reddish", "greenish", "bluish"),
            preprocess=colour,
        ),
    )


def many() -> Pipeline:
    return Pipeline(
        name="toy-many",
        detector=Detector(key="grid", architecture=lambda _classes: Grid(500), labels=("cell",)),
        classifier=Classifier(
            key="thousand",
            architecture=seeded_classifier,
            labels=tuple(f"species-{i:04d}" for i in range(1000)),
            preprocess=Preprocess(size=16, resize="squash", mean=HALF, std=HALF),
        ),
    )
