"""The pipeline registry: name -> architecture and input size."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torchvision import models


@dataclass(frozen=True)
class PipelineSpec:
    name: str
    build: Callable[[int], nn.Module]
    input_size: int
    description: str


def _resnet18(num_classes: int) -> nn.Module:
    return models.resnet18(weights=None, num_classes=num_classes)


def _mobilenet_v3_small(num_classes: int) -> nn.Module:
    return models.mobilenet_v3_small(weights=None, num_classes=num_classes)


PIPELINES: dict[str, PipelineSpec] = {
    spec.name: spec
    for spec in (
        PipelineSpec("resnet18-classifier", _resnet18, 224, "torchvision ResNet-18 classifier"),
        PipelineSpec(
            "mobilenet-v3-small-classifier",
            _mobilenet_v3_small,
            224,
            "torchvision MobileNetV3-Small classifier",
        ),
    )
}


def get_pipeline(name: str) -> PipelineSpec:
    try:
        return PIPELINES[name]
    except KeyError:
        raise KeyError(f"unknown pipeline {name!r}; known: {', '.join(PIPELINES)}") from None
