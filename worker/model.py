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

from datasets.errors import PermanentError
from datasets.sources import SourceConfig, read_bytes
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
        blob = read_bytes(as_uri(weights), sources)
        self.labels = _parse_labels(read_bytes(labels_uri(weights), sources))
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
        self.model = model.eval().to(self.device)
        self._mean = torch.tensor(_MEAN, device=self.device).view(1, 3, 1, 1) * 255.0
        self._std = torch.tensor(_STD, device=self.device).view(1, 3, 1, 1) * 255.0

    def predict(self, images: torch.Tensor) -> list[list[dict[str, Any]]]:
        """``images``: (N, 3, H, W) uint8. Returns N lists of {label, score}, best first."""
        on_gpu = self.device.type == "cuda"
        if on_gpu:
            images = images.pin_memory()
        with torch.inference_mode():
            batch = images.to(self.device, non_blocking=on_gpu).float()
            batch = (batch - self._mean) / self._std
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
