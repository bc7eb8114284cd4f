"""The classifier module layouts AMI's checkpoints were saved from, built by name.

- ``ami_resnet50``: AMI's ResNet-50 wrapper: torchvision's ResNet-50 without its pooling and
  ``fc`` as ``backbone`` (a Sequential: keys ``backbone.0.weight`` ... ``backbone.7.*``), an
  ``avgpool``, and ``classifier``, a Linear without bias.
- ``timm/<name>``: a timm model (``resnet50``, ``convnext_tiny_in22k``,
  ``tf_efficientnetv2_b3``); timm is the optional extra ``ami``, imported here only.

torchvision's own ``resnet50`` (``fc`` with bias) is ``pipelines.architectures``' built-in.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from config.errors import ConfigError

TIMM_MODELS = ("resnet50", "convnext_tiny_in22k", "tf_efficientnetv2_b3")
TIMM_PREFIX = "timm/"
CLASSIFIERS = ("ami_resnet50", *(TIMM_PREFIX + name for name in TIMM_MODELS))


class AmiResnet50(nn.Module):
    """ResNet-50 features, global average pooling, a linear layer without bias."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        from torchvision import models

        resnet = models.resnet50(weights=None)
        features = resnet.fc.in_features
        self.backbone = nn.Sequential(*list(resnet.children())[:-2])
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.classifier = nn.Linear(features, num_classes, bias=False)

    def forward(self, x: Any) -> Any:
        x = self.avgpool(self.backbone(x))
        return self.classifier(x.flatten(1))


def build(architecture: str, num_classes: int) -> nn.Module:
    """The module ``architecture`` (one of ``CLASSIFIERS``) names, randomly initialised."""
    if architecture == "ami_resnet50":
        return AmiResnet50(num_classes)
    name = architecture.removeprefix(TIMM_PREFIX)
    if not architecture.startswith(TIMM_PREFIX) or name not in TIMM_MODELS:
        raise ConfigError(f"unknown AMI architecture {architecture!r}; known: {CLASSIFIERS}")
    try:
        import timm
    except ImportError:
        raise ConfigError(
            f"architecture {architecture!r} needs timm: install the extra "
            "inference-worker[ami] (pip install 'inference-worker[ami]')"
        ) from None
    with warnings.catch_warnings():  # AMI's name for convnext_tiny.fb_in22k: the same model
        warnings.filterwarnings("ignore", message="Mapping deprecated model name")
        model: nn.Module = timm.create_model(name, pretrained=False, num_classes=num_classes)
    return model
