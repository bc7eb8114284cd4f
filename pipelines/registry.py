"""From ``WORKER_MODEL__PIPELINE`` to a ``Pipeline``: a built-in name, one of AMI's pipeline
slugs (``pipelines/ami/catalogue.py``; their files under ``WORKER_MODEL__FILES_MIRROR`` when
set), a ``.toml`` file that declares one, ``module:attribute``, or a name published by an
installed package under the entry-point group ``inference_worker.pipelines``. Imports no
torch (a plugin may)."""

from __future__ import annotations

import importlib
import tomllib
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from config.errors import ConfigError
from config.names import env_name
from pipelines.ami import catalogue
from pipelines.declare import Classifier, Detector, Pipeline, Preprocess, problems

ENTRY_POINT_GROUP = "inference_worker.pipelines"

# Single-stage pipelines whose weights are WORKER_MODEL__WEIGHTS (labels.txt beside them).
_CLASSIFIERS = {
    "resnet18-classifier": "resnet18",
    "resnet50-classifier": "resnet50",
    "mobilenet-v3-small-classifier": "mobilenet_v3_small",
    "mobilenet-v3-large-classifier": "mobilenet_v3_large",
    "convnext-tiny-classifier": "convnext_tiny",
    "exported-classifier": "exported",
}
_DETECTORS = {
    "fasterrcnn-mobilenet-detector": "fasterrcnn_mobilenet_v3_large_fpn",
    "fasterrcnn-resnet50-detector": "fasterrcnn_resnet50_fpn",
}
BUILT_IN = (*_CLASSIFIERS, *_DETECTORS)
CATALOGUE = catalogue.SLUGS  # AMI's pipelines: their weights are AMI's published files
_PIPELINE = env_name("model", "pipeline")


def resolve(name: str, weights: str = "", files_mirror: str = "") -> Pipeline:
    """The pipeline ``name`` stands for; ConfigError saying why when there is none.
    ``files_mirror``: the base URI standing for AMI's in catalogue pipelines' file URLs."""
    if name in BUILT_IN and not weights:
        raise ConfigError(
            f"{env_name('model', 'weights')} is not set; pipeline {name} needs a state_dict "
            "path or an s3:// URI (labels.txt beside it)"
        )
    if name in _CLASSIFIERS:
        pipeline = Pipeline(
            name, classifier=Classifier(name, name, _CLASSIFIERS[name], weights or None)
        )
    elif name in _DETECTORS:
        pipeline = Pipeline(
            name, detector=Detector(name, name, _DETECTORS[name], weights or None, labels=None)
        )
    elif name in CATALOGUE:
        pipeline = catalogue.pipeline(name, files_mirror)
    else:
        pipeline = _declared(name)
    found = problems(pipeline)
    if found:
        raise ConfigError(f"{_PIPELINE}={name!r}: " + "; ".join(found))
    return pipeline


def name_of(value: str) -> str:
    """The pipeline name (the ``tasks.<pipeline>`` token) that ``WORKER_MODEL__PIPELINE=value``
    stands for; loads no weights."""
    if value in BUILT_IN or value in CATALOGUE:
        return value
    pipeline = _declared(value)
    if not isinstance(pipeline, Pipeline):
        raise ConfigError(f"{_PIPELINE}={value!r} is not a Pipeline")
    return pipeline.name


def _declared(name: str) -> Any:
    """What a pipeline declared outside the registry is: a TOML file, ``module:attribute``, or
    an installed entry point (checked by the caller)."""
    if name.endswith(".toml"):
        return from_toml(Path(name))
    if ":" in name:
        return _from_attribute(name)
    return _from_entry_point(name)


def _called(name: str, value: Any) -> Any:
    """``value``, or what it returns when it is a function making the pipeline."""
    if not callable(value) or isinstance(value, Pipeline):
        return value
    try:
        return value()
    except Exception as error:  # noqa: BLE001 - the user's code: a configuration problem
        raise ConfigError(
            f"{_PIPELINE}={name!r}: making the pipeline failed: {type(error).__name__}: {error}"
        ) from None


def _from_attribute(name: str) -> Pipeline:
    module_name, _, attribute = name.partition(":")
    try:
        value: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            value = getattr(value, part)
    except Exception as error:  # noqa: BLE001 - an import runs the user's code
        raise ConfigError(
            f"{_PIPELINE}={name!r}: cannot import it: {type(error).__name__}: {error}"
        ) from None
    return _called(name, value)


def _from_entry_point(name: str) -> Pipeline:
    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not found:
        installed = sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
        raise ConfigError(
            f"{_PIPELINE}={name!r} is not a known pipeline; built in: "
            f"{', '.join(BUILT_IN)}; AMI's: {', '.join(CATALOGUE)}; "
            f"installed: {', '.join(installed) or 'none'}; "
            "or a .toml file, or module:attribute"
        )
    try:
        value = found[0].load()
    except Exception as error:  # noqa: BLE001 - a broken plugin is a configuration problem
        raise ConfigError(
            f"{_PIPELINE}={name!r}: the entry point {found[0].value} failed to "
            f"load: {type(error).__name__}: {error}"
        ) from None
    return _called(name, value)


def from_toml(path: Path) -> Pipeline:
    """A pipeline declared in TOML (docs/pipelines.md); relative weight and label paths are
    relative to the file."""
    try:
        table = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"{_PIPELINE}={str(path)!r}: {error}") from None
    base = path.resolve().parent
    try:
        return Pipeline(
            name=str(table.get("name", path.stem)),
            description=str(table.get("description", "")),
            detector=_stage(Detector, table.get("detector"), base),
            filter=_stage(Classifier, table.get("filter"), base),
            classifier=_stage(Classifier, table.get("classifier"), base),
        )
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{_PIPELINE}={str(path)!r}: {error}") from None


def _stage(kind: Any, table: Any, base: Path) -> Any:
    if table is None:
        return None
    if not isinstance(table, dict):
        raise TypeError(f"[{kind.__name__.lower()}] must be a table")
    values = dict(table)
    for field in ("weights", "labels"):
        if isinstance(values.get(field), str):
            values[field] = _beside(values[field], base)
    if isinstance(values.get("labels"), list):
        values["labels"] = tuple(str(label) for label in values["labels"])
    if "keep" in values:
        if not isinstance(values["keep"], list):
            raise TypeError('keep must be a list of labels, e.g. keep = ["moth"]')
        values["keep"] = tuple(str(label) for label in values["keep"])
    if "preprocess" in values:
        pre = dict(values["preprocess"])
        for field in ("mean", "std"):
            if field in pre:
                pre[field] = tuple(float(v) for v in pre[field])
        values["preprocess"] = Preprocess(**pre)
    return kind(**values)


def _beside(uri: str, base: Path) -> str:
    if "://" in uri or Path(uri).is_absolute():
        return uri
    return str(base / uri)
