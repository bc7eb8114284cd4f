"""The classifier prepared for inference gives the predictions of the model as trained."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from datasets.sources import SourceConfig
from pipelines.architectures import build_classifier
from pipelines.declare import Classifier
from pipelines.models import ClassifierModel, fold_batch_norms, save_classifier

_MEAN = torch.tensor((0.485, 0.456, 0.406)).view(1, 3, 1, 1) * 255.0
_STD = torch.tensor((0.229, 0.224, 0.225)).view(1, 3, 1, 1) * 255.0


def _with_trained_looking_norms(model: nn.Module, seed: int = 0) -> nn.Module:
    """Batch norms as after training (a fresh one is nearly the identity, hiding mistakes)."""
    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            n = module.num_features
            module.running_mean.copy_(torch.randn(n, generator=generator) * 0.5)
            module.running_var.copy_(torch.rand(n, generator=generator) + 0.5)
            module.weight.data.copy_(torch.rand(n, generator=generator) + 0.5)
            module.bias.data.copy_(torch.randn(n, generator=generator) * 0.1)
    return model.eval()


@pytest.mark.parametrize("architecture", ["mobilenet_v3_small", "resnet18"])
def test_folding_batch_norms_keeps_the_outputs(architecture):
    model = _with_trained_looking_norms(build_classifier(architecture, 10))
    folded = fold_batch_norms(copy.deepcopy(model))
    images = torch.rand(4, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected, got = model(images), folded(images)
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_every_batch_norm_after_a_convolution_is_folded_in_mobilenet():
    model = _with_trained_looking_norms(build_classifier("mobilenet_v3_small", 10))
    before = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    folded = fold_batch_norms(model)
    assert before > 0
    assert not any(isinstance(m, nn.BatchNorm2d) for m in folded.modules())


def test_the_classifier_gives_the_logits_of_the_saved_model(tmp_path):
    labels = [f"c{i}" for i in range(10)]
    weights = save_classifier("mobilenet_v3_small", labels, str(tmp_path))
    reference = _with_trained_looking_norms(build_classifier("mobilenet_v3_small", len(labels)))
    torch.save(reference.state_dict(), weights)  # trained-looking weights on disk
    stage = Classifier("species", architecture="mobilenet_v3_small", weights=weights)
    classifier = ClassifierModel(stage, SourceConfig(), torch.device("cpu"))

    images = torch.randint(0, 256, (5, 3, 224, 224), dtype=torch.uint8)
    with torch.inference_mode():
        expected = reference((images.float() - _MEAN) / _STD)

    assert classifier.algorithm.labels == tuple(labels)
    assert torch.allclose(classifier.logits(images), expected, atol=1e-3, rtol=1e-3)
