"""Pipelines Antenna can keep the results of (a detector first), with no weights files: the
demo's test detector, then a classifier over the given labels. Named ``module:attribute`` by
the Antenna tests (``tests.antenna_pipelines:animals``). ``colours_from_url``: the same with
its classifier's weights read from the URL in ``IW_TEST_COLOURS_WEIGHTS`` (read when the
worker declares it), for a file host that refuses a while."""

from __future__ import annotations

import os
from dataclasses import replace

from pipelines.declare import Classifier, Detector, Pipeline, Preprocess
from worker.commands.demo_models import HALF, BrightBoxesDetector, ColourClassifier

ANIMALS = ("cat", "dog", "bird", "fish", "horse")
COLOURS = ("red", "green", "blue")


def _boxes_then(name: str, labels: tuple[str, ...]) -> Pipeline:
    return Pipeline(
        name,
        detector=Detector(
            key="bright-boxes",
            name="Bright-boxes test detector",
            architecture=lambda _classes: BrightBoxesDetector(),
            labels=("box",),
            score_threshold=0.5,
        ),
        classifier=Classifier(
            key=f"{name}-classifier",
            name=f"{name} classifier",
            architecture=ColourClassifier,
            labels=labels,
            preprocess=Preprocess(size=32, resize="squash", mean=HALF, std=HALF),
        ),
    )


def animals() -> Pipeline:
    return _boxes_then("animals", ANIMALS)


def colours() -> Pipeline:
    return _boxes_then("colours", COLOURS)


def colours_from_url() -> Pipeline:
    pipeline = _boxes_then("colours", COLOURS)
    assert pipeline.classifier is not None
    weights = os.environ["IW_TEST_COLOURS_WEIGHTS"]
    return replace(pipeline, classifier=replace(pipeline.classifier, weights=weights))
