"""Stages shared between pipelines: a stage declared the same way (same architecture, weights,
labels, preprocessing) on the same device and precision is loaded once, however many loaded
pipelines use it (AMI's catalogue: one detector and one moth / non-moth filter for all).

A loaded stage lives while a pipeline's runner holds it (weak references here), so unloading
the last pipeline that uses it frees it. A filter's ``keep`` and ``dropped_terminal`` are the
pipeline's, not the stage's: stages differing only in them are the same model.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any

import torch

from config.errors import ConfigError
from datasets.uris import SourceConfig
from pipelines.declare import Classifier, Detector
from pipelines.models import ClassifierModel, DetectorModel

_LOCK = threading.Lock()
_LOADED: weakref.WeakValueDictionary[Any, Any] = weakref.WeakValueDictionary()


def detector(
    stage: Detector, sources: SourceConfig, where: torch.device, precision: str, *more: Any
) -> DetectorModel:
    """The loaded ``stage``: the one already loaded when there is one. ``more``: the rest of
    the model's arguments, the same for every stage of a process."""
    found: DetectorModel = _shared(DetectorModel, stage, sources, where, precision, *more)
    return found


def classifier(
    stage: Classifier, sources: SourceConfig, where: torch.device, precision: str, *more: Any
) -> ClassifierModel:
    """The loaded ``stage`` (its ``keep`` checked against its labels)."""
    as_model = dataclasses.replace(stage, keep=(), dropped_terminal=True)
    model: ClassifierModel = _shared(ClassifierModel, as_model, sources, where, precision, *more)
    unknown = [label for label in stage.keep if label not in model.algorithm.labels]
    if unknown:
        raise ConfigError(f"stage {stage.key!r} keeps labels it does not have: {unknown}")
    return model


def _shared(
    kind: Any, stage: Any, sources: SourceConfig, where: torch.device, precision: str, *more: Any
) -> Any:
    try:
        key = (kind.__name__, stage, str(where), precision)
        hash(key)
    except TypeError:  # a stage holding something unhashable: not shared
        return kind(stage, sources, where, precision, *more)
    with _LOCK:
        model = _LOADED.get(key)
        if model is None:
            model = kind(stage, sources, where, precision, *more)
            _LOADED[key] = model
        return model
