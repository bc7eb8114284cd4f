"""Built-in architectures by name: torchvision's, and the layouts AMI's checkpoints were saved
from (``pipelines/ami/layouts.py``: ``ami_resnet50``, ``timm/...``). Never downloads weights:
every ``weights`` and ``weights_backbone`` argument is None, and the stage loads its own
``state_dict``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from config.errors import ConfigError

TORCHVISION = ("resnet18", "resnet50", "mobilenet_v3_small", "mobilenet_v3_large", "convnext_tiny")
AMI = ("ami_resnet50", "timm/resnet50", "timm/convnext_tiny_in22k", "timm/tf_efficientnetv2_b3")
CLASSIFIERS = TORCHVISION + AMI
DETECTORS = ("fasterrcnn_resnet50_fpn", "fasterrcnn_mobilenet_v3_large_fpn")
BUILT_IN = CLASSIFIERS + DETECTORS


def build_classifier(architecture: str, num_classes: int) -> nn.Module:
    """A torchvision classifier as torchvision's own builder makes it, or one of AMI's layouts."""
    from torchvision import models

    if architecture not in CLASSIFIERS:
        raise ConfigError(
            f"unknown classifier architecture {architecture!r}; built in: {', '.join(CLASSIFIERS)}"
        )
    if architecture in AMI:
        from pipelines.ami import layouts

        return layouts.build(architecture, num_classes)
    builder: Callable[..., nn.Module] = getattr(models, architecture)
    return builder(weights=None, num_classes=num_classes)


def build_detector(architecture: str, num_classes: int, **options: Any) -> nn.Module:
    """A torchvision detector; ``options`` (min_size, max_size, box_score_thresh,
    box_detections_per_img) go to its constructor."""
    from torchvision.models import detection

    if architecture not in DETECTORS:
        raise ConfigError(
            f"unknown detector architecture {architecture!r}; built in: {', '.join(DETECTORS)}"
        )
    builder: Callable[..., nn.Module] = getattr(detection, architecture)
    return builder(weights=None, weights_backbone=None, num_classes=num_classes, **options)
