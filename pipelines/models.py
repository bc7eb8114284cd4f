"""A declared stage made real: weights read once (a path, https:// or s3://, through the
model-file cache, ``pipelines.files``), the model built and prepared for inference on a device.
Takes tensors, returns tensors."""

from __future__ import annotations

import hashlib
import io
import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import torch
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval

from config.errors import ConfigError, PermanentError
from config.names import env_name
from config.redact import redact_url
from datasets.uris import SourceConfig
from pipelines import architectures
from pipelines.declare import Classifier, Detector, Pipeline, Registered
from pipelines.device import autocast
from pipelines.files.fetch import ModelFiles
from pipelines.found import Ref

LABELS_FILE = "labels.txt"
NO_WEIGHTS = "none"


@dataclass(frozen=True)
class Algorithm:
    """One stage as results name it: Antenna's ``AlgorithmReference`` plus what identifies
    its weights and classes."""

    key: str
    name: str
    task_type: str
    weights_sha256: str
    labels: tuple[str, ...]
    registered: Registered | None = None  # the publisher's identity in Antenna, when fixed

    def reference(self) -> Ref:
        return Ref(self.name, self.key)

    def config(self) -> dict[str, Any]:
        """Antenna's ``AlgorithmConfigResponse``, category map included (published once)."""
        return {
            "name": self.name,
            "key": self.key,
            "task_type": self.task_type,
            "version_name": self.weights_sha256[:12],
            "weights_sha256": self.weights_sha256,
            "category_map": {
                "labels": list(self.labels),
                "data": [{"label": label, "index": i} for i, label in enumerate(self.labels)],
            },
        }


def as_uri(weights: str) -> str:
    if "://" in weights:
        return weights
    return "file://" + os.path.abspath(weights)


def labels_uri(weights: str) -> str:
    """labels.txt in the same directory or prefix as the weights."""
    head, _, _ = as_uri(weights).rpartition("/")
    return f"{head}/{LABELS_FILE}"


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise PermanentError(f"{env_name('model', 'device')}={device} but CUDA is not available")
    return resolved


def _labels(stage: Classifier | Detector, files: ModelFiles) -> tuple[str, ...]:
    if isinstance(stage.labels, tuple):
        labels = stage.labels
    else:
        uri = stage.labels if stage.labels else labels_uri(stage.weights or "")
        text = files.read(as_uri(uri), stage.labels_digest).decode("utf-8")
        if (urlsplit(uri).path if "://" in uri else uri).endswith(".json"):  # not the query
            from pipelines.ami.category_map import labels_of

            labels = labels_of(text, uri)
        else:
            labels = tuple(line.strip() for line in text.splitlines() if line.strip())
    if not labels:
        raise ConfigError(f"stage {stage.key!r} has no labels")
    return labels


def _load(
    stage: Classifier | Detector, num_classes: int, files: ModelFiles, **options: Any
) -> tuple[nn.Module, str, bool]:
    """(model, weights sha256, whether it is an exported program)."""
    if stage.weights is None:
        assert callable(stage.architecture)  # declare.problems() rules out the rest
        return stage.architecture(num_classes), NO_WEIGHTS, False
    blob = files.read(as_uri(stage.weights), stage.weights_digest)
    sha256 = hashlib.sha256(blob).hexdigest()
    if stage.architecture == "exported":
        program = torch.export.load(io.BytesIO(blob))
        return program.module(), sha256, True
    if callable(stage.architecture):
        model = stage.architecture(num_classes)
    elif isinstance(stage, Detector):
        model = architectures.build_detector(stage.architecture, num_classes, **options)
    else:
        model = architectures.build_classifier(stage.architecture, num_classes)
    state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    if stage.checkpoint_entry and isinstance(state, dict) and state.get(stage.checkpoint_entry):
        state = state[stage.checkpoint_entry]
    try:
        model.load_state_dict(state)
    except RuntimeError as error:
        raise PermanentError(
            f"weights {redact_url(stage.weights)} do not fit stage {stage.key!r} "
            f"({stage.architecture}, {num_classes} classes): {str(error).splitlines()[0]}"
        ) from None
    return model, sha256, False


class ClassifierModel:
    """Logits for a batch of square uint8 images, normalised as the model was trained."""

    def __init__(
        self,
        stage: Classifier,
        sources: SourceConfig,
        device: torch.device,
        precision: str = "float32",
        files: ModelFiles | None = None,
    ) -> None:
        """``files``: the host's model-file cache (built once from the settings); None reads
        through ``sources`` uncached (tests, benchmarks)."""
        files = files or ModelFiles(sources)
        self.stage = stage
        self.device = device
        self.precision = precision
        labels = _labels(stage, files)
        unknown = [label for label in stage.keep if label not in labels]
        if unknown:
            raise ConfigError(f"stage {stage.key!r} keeps labels it does not have: {unknown}")
        model, sha256, exported = _load(stage, len(labels), files)
        self.model = model.to(device) if exported else prepare_for_inference(model, device)
        self.algorithm = Algorithm(
            stage.key, stage.name or stage.key, "classification", sha256, labels, stage.registered
        )
        pre = stage.preprocess
        mean = torch.tensor(pre.mean, device=device).view(1, 3, 1, 1) * 255.0
        std = torch.tensor(pre.std, device=device).view(1, 3, 1, 1) * 255.0
        self._scale, self._shift = 1.0 / std, -mean / std
        # One forward pass now: a model whose output does not fit its labels fails the start,
        # not every task.
        self.logits(torch.zeros((2, 3, pre.size, pre.size), dtype=torch.uint8))

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        """``images``: (N, 3, S, S) uint8, on the host or already on the device. Returns
        (N, classes) float32 on the host."""
        return self.checked(self.forward(images).cpu())

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """The forward pass, left on the device: (N, classes) float32. The host does not wait
        for it (see ``checked``)."""
        with torch.inference_mode():
            batch = images.to(self.device, dtype=torch.float32, memory_format=torch.channels_last)
            batch = torch.addcmul(self._shift, batch, self._scale)  # (x - mean) / std, one pass
            with autocast(self.device, self.precision):
                out = self.model(batch)
            if not isinstance(out, torch.Tensor) or out.shape != (
                len(images),
                len(self.algorithm.labels),
            ):
                shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise ConfigError(
                    f"classifier {self.stage.key!r} gave logits of shape {shape} for "
                    f"{len(images)} images and {len(self.algorithm.labels)} labels"
                )
            return out.float()

    def checked(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits brought to the host, refused when any is not finite."""
        if not torch.isfinite(logits).all():
            raise PermanentError(
                f"classifier {self.stage.key!r} gave non-finite logits for this image",
                kind="invalid_model_output",
            )
        return logits


@dataclass(frozen=True)
class Boxes:
    """One image's detections in the pixels of the image the detector saw."""

    boxes: torch.Tensor  # (K, 4) x1 y1 x2 y2, float
    scores: torch.Tensor  # (K,)
    labels: torch.Tensor  # (K,) int, 1-based (0 is background)


class DetectorModel:
    def __init__(
        self,
        stage: Detector,
        sources: SourceConfig,
        device: torch.device,
        precision: str = "float32",
        files: ModelFiles | None = None,
    ) -> None:
        """``files``: the host's model-file cache (built once from the settings); None reads
        through ``sources`` uncached (tests, benchmarks)."""
        files = files or ModelFiles(sources)
        self.stage = stage
        self.device = device
        self.precision = precision
        labels = _labels(stage, files)
        options = {
            "min_size": stage.min_size,
            "max_size": stage.max_size,
            "box_score_thresh": stage.score_threshold,
            "box_detections_per_img": stage.max_detections,
        }
        num_classes = stage.num_classes or len(labels) + 1
        model, sha256, _exported = _load(stage, num_classes, files, **options)
        built_in = stage.architecture in architectures.DETECTORS
        if stage.frozen_batch_norms:
            model = freeze_batch_norms(model, in_place=built_in)
        self.model = model.eval().to(device)
        if device.type == "cpu" and built_in:  # oneDNN's faster convolutions, same boxes
            self.model = self.model.to(memory_format=torch.channels_last)
        self.algorithm = Algorithm(
            stage.key, stage.name or stage.key, "detection", sha256, labels, stage.registered
        )

    def detect(self, images: list[torch.Tensor]) -> list[Boxes]:
        """``images``: (3, H, W) uint8 on the host or the device, any sizes. Boxes in those
        images' pixels, at most ``max_detections`` each, best first, at or over the score
        threshold (``forward``, ``rows`` and ``cleaned`` in one call)."""
        rows, counts = self.rows(self.forward(images))
        return self.cleaned(images, rows.cpu(), counts)

    def forward(self, images: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """The forward pass; its outputs stay on the device (see ``rows``). With
        ``sizes_apart``, images of different sizes go through the model in separate calls."""
        groups = _by_size(images) if self.stage.sizes_apart else [list(range(len(images)))]
        outputs: list[dict[str, torch.Tensor]] = [{} for _ in images]
        with torch.inference_mode():
            batch = [image.to(self.device).float().div_(255.0) for image in images]
            with autocast(self.device, self.precision):
                for group in groups:
                    found = self.model([batch[i] for i in group])
                    for i, out in zip(group, found, strict=True):
                        outputs[i] = out
        return outputs

    @staticmethod
    def rows(outputs: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, list[int]]:
        """Every image's detections in one (K, 6) float32 tensor, where they are (x1 y1 x2 y2,
        score, label), and how many are each image's."""
        with torch.inference_mode():
            where = outputs[0]["boxes"].device if outputs else torch.device("cpu")
            rows = [_as_rows(out, where) for out in outputs]
            return (torch.cat(rows) if rows else torch.zeros((0, 6))), [len(r) for r in rows]

    def cleaned(
        self, images: list[torch.Tensor], rows: torch.Tensor, counts: list[int]
    ) -> list[Boxes]:
        """``rows`` (on the host) as each image's boxes: clamped to the image; non-finite, empty
        or under-threshold ones dropped; at most ``max_detections``, best first."""
        found = []
        for image, row in zip(images, rows.split(counts), strict=True):
            _, height, width = image.shape
            boxes, scores, labels = row[:, :4].clone(), row[:, 4], row[:, 5].long()
            usable = torch.isfinite(boxes).all(dim=1) & torch.isfinite(scores)
            boxes = torch.nan_to_num(boxes)
            if self.stage.whole_pixel_boxes:
                boxes = boxes.trunc()
            boxes[:, 0::2] = boxes[:, 0::2].clamp(0, width)
            boxes[:, 1::2] = boxes[:, 1::2].clamp(0, height)
            usable &= (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
            usable &= scores >= self.stage.score_threshold
            keep = torch.nonzero(usable).flatten()
            keep = keep[torch.argsort(scores[keep], descending=True)][: self.stage.max_detections]
            found.append(Boxes(boxes[keep], scores[keep], labels[keep]))
        return found

    def label(self, index: int) -> str:
        labels = self.algorithm.labels
        return labels[index - 1] if 1 <= index <= len(labels) else str(index)


def _by_size(images: list[torch.Tensor]) -> list[list[int]]:
    """Indices of ``images`` grouped by (height, width), in first-seen order."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, image in enumerate(images):
        groups.setdefault((int(image.shape[-2]), int(image.shape[-1])), []).append(i)
    return list(groups.values())


def _as_rows(out: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """One image's detections as (K, 6) float32 on ``device``: x1 y1 x2 y2, score, label (a
    model may leave some outputs on another device, an empty one on the host say)."""
    columns = [out["boxes"], out["scores"][:, None], out["labels"][:, None]]
    return torch.cat([column.to(device, torch.float32) for column in columns], dim=1)


def prepare_for_inference(model: nn.Module, device: torch.device) -> nn.Module:
    """Eval mode, batch norms folded into their convolutions, channels-last weights on ``device``.

    The same outputs (to float rounding) for less work: on this project's benchmark machine a
    MobileNetV3-Small forward pass on the CPU took about half the time (BENCHMARKS.md).
    """
    model = fold_batch_norms(model.eval())
    return model.to(device).to(memory_format=torch.channels_last)


def fold_batch_norms(module: nn.Module) -> nn.Module:
    """Fold every BatchNorm2d that directly follows a Conv2d inside a Sequential into that
    convolution (eval mode only). Pairs held as named attributes (ResNet's conv1/bn1) stay as
    they are; its downsample branches, which are Sequentials, are folded."""
    for child in module.children():
        if isinstance(child, nn.Sequential):
            for i in range(len(child) - 1):
                conv, norm = child[i], child[i + 1]
                if (
                    isinstance(conv, nn.Conv2d)
                    and isinstance(norm, nn.BatchNorm2d)
                    and norm.track_running_stats
                    and not conv.training
                    and not norm.training
                ):
                    child[i] = fuse_conv_bn_eval(conv, norm)
                    child[i + 1] = nn.Identity()
        fold_batch_norms(child)
    return module


def freeze_batch_norms(module: nn.Module, in_place: bool = False) -> nn.Module:
    """Every BatchNorm2d replaced by torchvision's FrozenBatchNorm2d holding its statistics: the
    same function, computed as torchvision's pretrained-backbone detectors compute it (scale and
    shift, not ``batch_norm``), so to the bit as a model built that way. ``in_place``: computed
    over its input (``pipelines/frozen_norm.py``), for models whose norms each read a
    convolution's fresh output (torchvision's built-in detectors)."""
    from torchvision.ops.misc import FrozenBatchNorm2d

    from pipelines.frozen_norm import InPlaceFrozenBatchNorm2d

    norm = InPlaceFrozenBatchNorm2d if in_place else FrozenBatchNorm2d
    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d) and child.track_running_stats and child.affine:
            frozen = norm(child.num_features, eps=child.eps)
            with torch.no_grad():
                frozen.weight.copy_(child.weight)
                frozen.bias.copy_(child.bias)
                frozen.running_mean.copy_(child.running_mean)
                frozen.running_var.copy_(child.running_var)
            setattr(module, name, frozen.to(child.weight.device))
        else:
            freeze_batch_norms(child, in_place)
    return module


def save_classifier(architecture: str, labels: list[str], directory: str, seed: int = 0) -> str:
    """Write a randomly initialised built-in classifier and its labels.txt (demos and tests).
    Returns the weights' path."""
    return _save(architectures.build_classifier, architecture, len(labels), labels, directory, seed)


def save_detector(architecture: str, labels: list[str], directory: str, seed: int = 0) -> str:
    """Write a randomly initialised built-in detector (classes: background + ``labels``)."""
    return _save(
        architectures.build_detector, architecture, len(labels) + 1, labels, directory, seed
    )


def _save(
    build: Any, architecture: str, num_classes: int, labels: list[str], directory: str, seed: int
) -> str:
    from pathlib import Path

    torch.manual_seed(seed)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "model.pt"
    torch.save(build(architecture, num_classes).state_dict(), path)
    (out / LABELS_FILE).write_text("\n".join(labels) + "\n")
    return str(path)


def stage_files(pipelines: list[Pipeline]) -> list[tuple[str, str | None]]:
    """(URI, declared digest) of every weights and labels file the pipelines read, each once."""
    found: dict[str, str | None] = {}
    for pipeline in pipelines:
        for stage in pipeline.stages():
            if stage.weights is not None:
                found.setdefault(as_uri(stage.weights), stage.weights_digest)
            if not isinstance(stage.labels, tuple):
                uri = stage.labels or labels_uri(stage.weights or "")
                found.setdefault(as_uri(uri), stage.labels_digest)
    return list(found.items())
