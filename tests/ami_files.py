"""A local mirror of AMI's model files for tests (``WORKER_MODEL__FILES_MIRROR``): random
weights saved in the layouts and checkpoint forms AMI's files have, small category maps in
AMI's JSON form (``{label: index}``), at AMI's relative paths.

The random detector is made to find boxes: its proposals are the anchors, every one scores
about 1 and grows about 60 times (past the image), so clipping leaves large boxes, which NMS
thins to a handful per image.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pipelines import architectures
from pipelines.ami import catalogue

BINARY_MAP = {"moth": 0, "nonmoth": 1}  # a made-up order: the code must read the indices
SPECIES = ("Alpha beta", "Gamma delta", "Epsilon zeta")


def species_map() -> dict[str, int]:
    """Indices deliberately not in the order of the keys."""
    return {label: (i + 1) % len(SPECIES) for i, label in enumerate(SPECIES)}


def labels_by_index(mapping: dict[str, int]) -> list[str]:
    return [label for label, _ in sorted(mapping.items(), key=lambda item: item[1])]


def _write(path: Path, value: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(value, dict) and all(isinstance(v, int) for v in value.values()):
        path.write_text(json.dumps(value))
    else:
        torch.save(value, path)


def detector_state(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model: Any = architectures.build_detector("fasterrcnn_resnet50_fpn", 2)
    predictor = model.roi_heads.box_predictor
    rpn = model.rpn.head
    with torch.no_grad():
        for layer in (rpn.bbox_pred, rpn.cls_logits):  # proposals: the anchors themselves
            layer.weight.zero_()
            layer.bias.zero_()
        predictor.cls_score.weight.zero_()
        predictor.cls_score.bias.copy_(torch.tensor([-6.0, 6.0]))  # "object" scores ~1
        predictor.bbox_pred.weight.zero_()
        predictor.bbox_pred.bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 30.0, 30.0]))
    state: dict[str, torch.Tensor] = model.state_dict()
    return state


def classifier_state(
    architecture: str, classes: int, seed: int, favour: int | None = None
) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model: Any = architectures.build_classifier(architecture, classes)
    if favour is not None:  # the torchvision layout's fc has a bias: push one class up
        with torch.no_grad():
            model.fc.bias.zero_()
            model.fc.bias[favour] = 50.0
    state: dict[str, torch.Tensor] = model.state_dict()
    return state


def write_mirror(root: Path, slugs: tuple[str, ...], detector: dict[str, torch.Tensor]) -> Path:
    """AMI's files for ``slugs`` under ``root``: the detector (``detector``, as AMI wraps it,
    under ``model_state_dict``), the binary filter (favouring ``moth``) bare, each slug's
    classifier wrapped, and the category maps."""
    _write(root / catalogue.DETECTOR.weights, {"model_state_dict": detector, "epoch": 30})
    binary = catalogue.BINARY
    assert binary.labels is not None
    _write(root / binary.weights, classifier_state("resnet50", 2, 1, BINARY_MAP["moth"]))
    _write(root / binary.labels, BINARY_MAP)
    for seed, slug in enumerate(slugs, start=2):
        model = catalogue.model_of(slug)
        if model is binary:
            continue
        assert model.labels is not None
        state = classifier_state(model.architecture, len(SPECIES), seed)
        _write(root / model.weights, {"model_state_dict": state})
        _write(root / model.labels, species_map())
    return root
