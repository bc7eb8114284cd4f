"""What a pipeline is, as data: stages, their models, weights, labels and preprocessing.

This is the interface for bringing your own model (docs/pipelines.md, "Your own model"). A
pipeline is a ``Pipeline`` value; a package publishes one under the entry-point group
``inference_worker.pipelines`` (or names it as ``module:attribute``). Imports no torch.

- ``architecture``: a built-in name (``pipelines.architectures.BUILT_IN``), ``"exported"`` for
  a ``torch.export`` program (``.pt2``, no code needed), or a callable
  ``build(num_classes) -> torch.nn.Module``.
  A classifier module maps a float batch (N, 3, S, S), normalised, to logits (N, classes).
  A detector module follows torchvision's detection interface: a list of float (3, H, W)
  images in [0, 1] to a list of ``{"boxes": (K, 4) x1 y1 x2 y2 in that image's pixels,
  "scores": (K,), "labels": (K,)}``.
- ``weights``: a ``state_dict`` (or ``.pt2``) path, ``https://`` or ``s3://`` URI; ``None``
  when the callable builds a complete model (its results then show ``weights_sha256: "none"``).
- ``labels``: a URI of a text file (one label a line), of a ``.json`` category map
  (``{label: index}``, AMI's form), the labels themselves, or ``None`` for ``labels.txt``
  beside the weights.
- ``weights_digest`` / ``labels_digest``: the file's sha256, or a prefix of at least 8 hex
  digits (torch hub's ``name-<8 hex>.ext`` convention); ``None``: the first download's sha256
  is recorded and held (``pipelines.files``).
- ``checkpoint_entry``: the checkpoint entry that holds the ``state_dict`` when there is one
  (``model_state_dict``); a checkpoint without it is the ``state_dict`` itself.
- ``registered``: how Antenna knows the stage when its publisher fixed that (AMI's catalogue,
  ``pipelines/ami``): its key, description and URIs are registered and written verbatim.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

Resize = Literal["squash", "shorter_crop"]
ResizeIn = Literal["uint8", "float"]
RESIZES = ("squash", "shorter_crop")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
Architecture = str | Callable[[int], Any]
_NAME = re.compile(r"[A-Za-z0-9_-]{1,128}")
_DIGEST = re.compile(r"[0-9a-f]{8,64}")


@dataclass(frozen=True)
class Preprocess:
    """What the model saw in training: input side, how the image was made square, mean/std.

    ``squash``: the whole image resized to size x size (aspect ratio not kept).
    ``shorter_crop``: shorter side to ``size``, then the centre ``size`` x ``size``
    (torchvision's ``Resize(size)`` then ``CenterCrop(size)``).
    """

    size: int = 224
    resize: Resize = "squash"
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    # A crop's resize: "uint8" rounds the resized pixels to uint8; "float" resizes the crop's
    # pixels as floats, unrounded (torchvision's ToTensor, then Resize(antialias=True)).
    resize_in: ResizeIn = "uint8"


@dataclass(frozen=True)
class Registered:
    """A stage's identity in Antenna as its publisher registers it (used verbatim)."""

    key: str
    description: str = ""
    version: int = 1
    uri: str | None = None  # the weights as the publisher names them
    labels_uri: str | None = None  # the category map as the publisher names it
    taxon_rank: str | None = None  # every category's rank in the category map


@dataclass(frozen=True)
class Classifier:
    key: str
    name: str = ""
    architecture: Architecture = "resnet18"
    weights: str | None = None
    weights_digest: str | None = None
    labels: str | tuple[str, ...] | None = None
    labels_digest: str | None = None
    preprocess: Preprocess = field(default_factory=Preprocess)
    # As a filter before another classifier: crops whose top label is one of these go on.
    keep: tuple[str, ...] = ()
    # As a filter: whether its label on a crop it does not keep is marked terminal (the crop's
    # last word). AMI's ``ami worker`` marks its filter's label non-terminal on every crop.
    dropped_terminal: bool = True
    checkpoint_entry: str | None = None
    registered: Registered | None = None


@dataclass(frozen=True)
class Detector:
    key: str
    name: str = ""
    architecture: Architecture = "fasterrcnn_mobilenet_v3_large_fpn"
    weights: str | None = None
    weights_digest: str | None = None
    labels: str | tuple[str, ...] | None = ("object",)
    labels_digest: str | None = None
    num_classes: int | None = None  # None: len(labels) + 1 (torchvision counts the background)
    score_threshold: float = 0.8
    max_detections: int = 500
    # Built-in detectors resize internally so the shorter side is min_size and the longer at
    # most max_size (torchvision's defaults); boxes come back in the input's pixels.
    min_size: int = 800
    max_size: int = 1333
    # Boxes truncated to whole pixels (toward zero) before they are reported and cut.
    whole_pixel_boxes: bool = False
    # Images detected at their own size, never reduced to WORKER_LOADER__MAX_SIDE (as AMI's
    # worker detects them); one over WORKER_LOADER__MAX_PIXELS is refused (too_large).
    full_size: bool = False
    # Images of different sizes detected in separate calls: torchvision pads a batch to its
    # largest image, which changes a smaller image's boxes; apart, each gets its own alone.
    sizes_apart: bool = False
    # Batch norms computed as torchvision's FrozenBatchNorm2d, as a detector built with a
    # pretrained backbone has them (the same function; other float rounding).
    frozen_batch_norms: bool = False
    checkpoint_entry: str | None = None
    registered: Registered | None = None


@dataclass(frozen=True)
class Pipeline:
    """A detector, a classifier, or a detector whose crops go to classifiers.

    With a ``filter``, every crop is classified by it; crops whose top label is in
    ``filter.keep`` also go to ``classifier``.
    """

    name: str
    detector: Detector | None = None
    filter: Classifier | None = None
    classifier: Classifier | None = None
    description: str = ""
    title: str = ""  # Antenna's pipeline name; the name (slug) when empty
    version: int = 1

    def stages(self) -> list[Detector | Classifier]:
        return [s for s in (self.detector, self.filter, self.classifier) if s is not None]


def problems(pipeline: Any) -> list[str]:
    """Why ``pipeline`` cannot be served; empty when it can."""
    if not isinstance(pipeline, Pipeline):
        return [f"expected a pipelines.declare.Pipeline, got {type(pipeline).__name__}"]
    found: list[str] = []
    if not _NAME.fullmatch(pipeline.name):
        found.append(f"pipeline name {pipeline.name!r} must be 1-128 of A-Z a-z 0-9 _ -")
    if pipeline.detector is None and pipeline.classifier is None:
        found.append(f"pipeline {pipeline.name!r} has neither a detector nor a classifier")
    if pipeline.filter is not None:
        if pipeline.detector is None:
            found.append("a filter classifies crops: the pipeline needs a detector")
        if not pipeline.filter.keep:
            found.append(f"filter {pipeline.filter.key!r} keeps no label: set keep")
    keys = [stage.key for stage in pipeline.stages()]
    if len(set(keys)) != len(keys):
        found.append(f"stage keys must differ, got {keys}")
    for stage in pipeline.stages():
        if not _NAME.fullmatch(stage.key):
            found.append(f"stage key {stage.key!r} must be 1-128 of A-Z a-z 0-9 _ -")
        if isinstance(stage.architecture, str) and stage.architecture == "exported":
            if not (stage.weights or "").endswith(".pt2"):
                found.append(f"stage {stage.key!r}: an exported model needs weights ending .pt2")
        elif stage.weights is None and isinstance(stage.architecture, str):
            found.append(f"stage {stage.key!r}: a built-in architecture needs weights")
        if isinstance(stage, Classifier):
            found += _preprocess_problems(stage)
        for digest in (stage.weights_digest, stage.labels_digest):
            if digest is not None and not _DIGEST.fullmatch(digest):
                found.append(f"stage {stage.key!r}: digest {digest!r} is not 8-64 hex digits")
        if isinstance(stage, Detector) and not 0 < stage.max_detections <= 10_000:
            found.append(f"stage {stage.key!r}: max_detections must be 1..10000")
    return found


_CROP_MODES = (("uint8", "squash"), ("uint8", "shorter_crop"), ("float", "squash"))


def _preprocess_problems(stage: Classifier) -> list[str]:
    pre, found = stage.preprocess, []
    if pre.size < 8:
        found.append(f"stage {stage.key!r}: preprocess.size must be at least 8")
    if pre.resize not in RESIZES:
        found.append(f"stage {stage.key!r}: preprocess.resize must be one of {RESIZES}")
    elif (pre.resize_in, pre.resize) not in _CROP_MODES:
        found.append(f"stage {stage.key!r}: preprocess.resize_in is uint8, or float to squash")
    return found
