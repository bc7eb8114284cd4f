"""Pipelines by name: declared in TOML beside their weights, refused naming the setting."""

from __future__ import annotations

import pytest

from config.errors import ConfigError
from pipelines.declare import Preprocess
from pipelines.models import save_classifier, save_detector
from pipelines.registry import name_of, resolve


def test_a_pipeline_declared_in_toml_resolves_paths_beside_the_file(tmp_path):
    save_detector("fasterrcnn_mobilenet_v3_large_fpn", ["moth"], str(tmp_path / "det"))
    save_classifier("resnet18", ["moth", "other"], str(tmp_path / "binary"))
    declaration = tmp_path / "moths.toml"
    declaration.write_text(
        """
name = "moths"
[detector]
key = "detector"
architecture = "fasterrcnn_mobilenet_v3_large_fpn"
weights = "det/model.pt"
labels = ["moth"]
[filter]
key = "moth-or-not"
architecture = "resnet18"
weights = "binary/model.pt"
keep = ["moth"]
preprocess = { size = 128, resize = "shorter_crop", mean = [0.5, 0.5, 0.5], std = [0.5, 0.5, 0.5] }
"""
    )
    pipeline = resolve(str(declaration))
    assert name_of(str(declaration)) == pipeline.name == "moths"
    assert pipeline.detector is not None and pipeline.filter is not None
    assert pipeline.detector.weights == str(tmp_path / "det" / "model.pt")
    assert pipeline.filter.preprocess == Preprocess(128, "shorter_crop", (0.5,) * 3, (0.5,) * 3)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (
            'name = "x"\n[classifier]\nkey = "c"\nweights = "w.pt"\npreprocess = { size = 3 }\n',
            "preprocess.size must be at least 8",
        ),
        ('name = "x"\n[classifier]\nkey = "c"\nweights = "w.pt"\nsize = 3\n', "size"),
        (
            'name = "x"\n[detector]\nkey = "d"\nweights = "w.pt"\n[filter]\nkey = "f"\n'
            'weights = "w.pt"\nkeep = "moth"\n',
            "keep must be a list",
        ),
        ('name = "x"\n[filter]\nkey = "f"\nweights = "w.pt"\nkeep = ["a"]\n', "needs a detector"),
        ('name = "x y"\n[classifier]\nkey = "c"\nweights = "w.pt"\n', "pipeline name"),
        ('name = "x"\n', "neither a detector nor a classifier"),
        ("name = ", "Invalid"),
    ],
)
def test_a_bad_declaration_is_refused_naming_the_setting(tmp_path, body, reason):
    declaration = tmp_path / "bad.toml"
    declaration.write_text(body)
    with pytest.raises(ConfigError, match="WORKER_MODEL__PIPELINE") as refused:
        resolve(str(declaration))
    assert reason in str(refused.value)
