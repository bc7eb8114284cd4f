"""Weights from a path or s3:// URI, a classifier built once, and top-k predictions.

Takes uint8 image tensors, returns predictions; knows nothing of NATS.
"""

from __future__ import annotations

import hashlib
import io
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval

from config.errors import PermanentError
from datasets.sources import SourceConfig, read_trusted
from worker.pipelines import PipelineSpec

_MEAN = (0.485, 0.456, 0.406)
_STD = (0.229, 0.224, 0.225)
LABELS_FILE = "labels.txt"


@dataclass(frozen=True)
class ModelInfo:
    name: str
    weights_sha256: str

    def as_dict(self) -> dict[str, str]:
        return {"name": self.name, "weights_sha256": self.weights_sha256}


def as_uri(weights: str) -> str:
    if "://" in weights:
        return weights
    return "file://" + os.path.abspath(weights)


def labels_uri(weights: str) -> str:
    """labels.txt in the same directory or prefix as the weights."""
    uri = as_uri(weights)
    head, _, _ = uri.rpartition("/")
    return f"{head}/{LABELS_FILE}"


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise PermanentError(f"WORKER_MODEL__DEVICE={device} but CUDA is not available")
    return resolved


class Classifier:
    """A torchvision classifier loaded once per process; ``predict`` runs in inference mode."""

    def __init__(
        self, spec: PipelineSpec, weights: str, sources: SourceConfig, device: str, top_k: int
    ) -> None:
        blob = read_trusted(as_uri(weights), sources)
        self.labels = _parse_labels(read_trusted(labels_uri(weights), sources))
        self.info = ModelInfo(spec.name, hashlib.sha256(blob).hexdigest())
        self.input_size = spec.input_size
        self.device = resolve_device(device)
        self.top_k = min(top_k, len(self.labels))
        state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        model = spec.build(len(self.labels))
        try:
            model.load_state_dict(state)
        except RuntimeError as error:
            raise PermanentError(
                f"weights {weights} do not fit pipeline {spec.name} with "
                f"{len(self.labels)} labels: {str(error).splitlines()[0]}"
            ) from None
        self.model = prepare_for_inference(model, self.device)
        mean = torch.tensor(_MEAN, device=self.device).view(1, 3, 1, 1) * 255.0
        std = torch.tensor(_STD, device=self.device).view(1, 3, 1, 1) * 255.0
        self._scale, self._shift = 1.0 / std, -mean / std

    def predict(self, images: torch.Tensor) -> list[list[dict[str, Any]]]:
        """``images``: (N, 3, H, W) uint8. Returns N lists of {label, score}, best first."""
        on_gpu = self.device.type == "cuda"
        if on_gpu:
            images = images.pin_memory()
        with torch.inference_mode():
            batch = images.to(self.device, non_blocking=on_gpu)
            batch = batch.to(dtype=torch.float32, memory_format=torch.channels_last)
            batch = torch.addcmul(self._shift, batch, self._scale)  # (x - mean) / std, one pass
            probs = torch.softmax(self.model(batch), dim=1)
            scores, indices = probs.topk(self.top_k, dim=1)
        scores_list = scores.cpu().tolist()
        indices_list = indices.cpu().tolist()
        return [
            [
                {"label": self.labels[i], "score": round(float(s), 6)}
                for i, s in zip(row_i, row_s, strict=True)
            ]
            for row_i, row_s in zip(indices_list, scores_list, strict=True)
        ]


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


def _parse_labels(data: bytes) -> list[str]:
    labels = [line.strip() for line in data.decode("utf-8").splitlines() if line.strip()]
    if not labels:
        raise PermanentError(f"{LABELS_FILE} beside the weights is empty")
    return labels


def save_classifier(spec: PipelineSpec, labels: list[str], directory: str, seed: int = 0) -> str:
    """Write a randomly initialised model and its labels; for demos and tests. Returns the path."""
    from pathlib import Path

    torch.manual_seed(seed)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "model.pt"
    torch.save(spec.build(len(labels)).state_dict(), path)
    (out / LABELS_FILE).write_text("\n".join(labels) + "\n")
    return str(path)
