"""The classifier prepared for inference gives the predictions of the model as trained."""

from __future__ import annotations

import copy
import hashlib

import pytest
import torch
from torch import nn

from config.errors import ConfigError
from datasets.images import DecodePlan, decode
from datasets.uris import SourceConfig
from pipelines.architectures import build_classifier
from pipelines.declare import Classifier, Pipeline, Preprocess
from pipelines.models import ClassifierModel, fold_batch_norms, save_classifier
from pipelines.registry import resolve
from pipelines.runner import load_runner
from worker.commands.demo_images import image_bytes

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


def test_an_exported_classifier_is_served_without_code(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)
    ).eval()
    example = torch.rand(2, 3, 32, 32)
    batch = torch.export.Dim("batch", min=1, max=1024)
    program = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
    path = tmp_path / "model.pt2"
    torch.export.save(program, str(path))
    (tmp_path / "labels.txt").write_text("a\nb\nc\nd\n")
    stage = Classifier(
        "exported", architecture="exported", weights=str(path), preprocess=Preprocess(size=32)
    )
    runner = load_runner(Pipeline("exported", classifier=stage), SourceConfig(), "cpu")
    assert runner.classifier is not None

    images = torch.randint(0, 256, (5, 3, 32, 32), dtype=torch.uint8)
    mean = torch.tensor(stage.preprocess.mean).view(1, 3, 1, 1) * 255
    std = torch.tensor(stage.preprocess.std).view(1, 3, 1, 1) * 255
    with torch.inference_mode():
        expected = model((images.float() - mean) / std)
    assert torch.allclose(runner.classifier.logits(images), expected, atol=1e-4)
    assert (
        runner.classifier.algorithm.weights_sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    )


def test_weights_that_do_not_fit_the_architecture_are_refused_with_the_stage(tmp_path):
    weights = save_classifier("resnet18", ["a", "b"], str(tmp_path))
    stage = Classifier("species", architecture="mobilenet_v3_small", weights=weights)
    with pytest.raises(Exception, match="do not fit stage 'species'"):
        load_runner(Pipeline("p", classifier=stage), SourceConfig(), "cpu")


@pytest.mark.parametrize(
    "architecture",
    ["resnet18", "resnet50", "mobilenet_v3_small", "mobilenet_v3_large", "convnext_tiny"],
)
def test_every_built_in_classifier_loads_its_saved_weights_and_classifies(tmp_path, architecture):
    weights = save_classifier(architecture, ["a", "b"], str(tmp_path))
    stage = Classifier("c", architecture=architecture, weights=weights, preprocess=Preprocess(32))
    runner = load_runner(Pipeline("p", classifier=stage), SourceConfig(), "cpu")
    (detections,) = runner.run([decode(image_bytes(64, 48, seed=1), DecodePlan(size=32))])
    assert detections[0].classifications[0].classification in ("a", "b")


def test_a_filter_keeping_a_label_it_does_not_have_is_refused_at_load(toy):
    from dataclasses import replace

    pipeline = resolve("toy_moths:moths")
    assert pipeline.filter is not None
    broken = replace(pipeline, filter=replace(pipeline.filter, keep=("moth",)))
    with pytest.raises(ConfigError, match="keeps labels it does not have"):
        load_runner(broken, SourceConfig(), "cpu")


def test_a_classifier_whose_output_does_not_fit_its_labels_fails_the_start(toy):
    stage = Classifier("c", architecture=toy.seeded_classifier, labels=("a", "b"))
    wrong = Classifier("c", architecture=lambda _n: toy.seeded_classifier(5), labels=("a", "b"))
    load_runner(Pipeline("p", classifier=stage), SourceConfig(), "cpu")
    with pytest.raises(ConfigError, match=r"logits of shape \(2, 5\) for 2 images and 2 labels"):
        load_runner(Pipeline("p", classifier=wrong), SourceConfig(), "cpu")
