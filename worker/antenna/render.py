"""What this worker posts to Antenna for one task, and what it registers: one module, so the
keys registered are the keys results name.

- Keys: an algorithm's Antenna key is its stage key and the first 12 hex digits of its weights'
  sha256 (``antenna_key``). Antenna's keys are global and write-once, so changed weights
  register, and answer under, a new key. A stage whose publisher fixed its identity
  (``Registered``: AMI's catalogue) registers and answers under that key, name, description
  and URIs verbatim, as AMI's own worker does.
- ``ok_result``: the response shaping's ``PipelineResultsResponse`` (``pipelines/response.py``
  via ``Result.response``), with ``pipeline`` the job's slug, ``source_images`` the task's image,
  and algorithm references under their Antenna keys. A detector alone writes its label as a
  one-score classification; Antenna registers a detector without a category map, so that
  classification is left out (the box is kept).
- ``problems``: everything that would make Antenna accept a result and then not save it, checked
  against what this worker registers; such a result is replaced by ``error_result``.
- ``fit``: a result over the post size cap has its scores compacted (cut to 3 decimals, below
  0.001 written as 0, the top score kept exact), then its logits rounded to 3 decimals; the
  logits are never dropped nor shortened. If it is still over, it becomes an error result. Why
  (RolnickLab/antenna ``main``): Antenna's class masking reads only a classification's
  ``logits``, whole (one per category, else it skips it), and masks only classifications whose
  logits are stored (``ami/ml/post_processing/class_masking.py``); its save takes
  ``max(scores)`` as the score and ``scores.index(max(scores))`` as the category, and stores
  ``scores`` and ``logits`` as sent (``ami/ml/models/pipeline.py``, ``create_classification``):
  scores cannot be left out, a compacted vector keeps all it reads.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pydantic

from config.names import env_name
from config.redact import redact_url, scrub, shorten
from pipelines.declare import Registered
from pipelines.models import Algorithm
from worker.antenna.schemas import PipelineResults
from worker.core.tasks import Task

_ERROR_CHARS = 1000
_SCORE_STEPS = 1000  # scores cut to 3 decimals
_LOGIT_DECIMALS = 3
ENVELOPE_BYTES = len(b'{"results":[]}')


def antenna_key(algorithm: Algorithm) -> str:
    if algorithm.registered is not None:
        return algorithm.registered.key
    return f"{algorithm.key}-{algorithm.weights_sha256[:12]}"


def _task_type(algorithm: Algorithm) -> str:
    return "localization" if algorithm.task_type == "detection" else algorithm.task_type


@dataclass(frozen=True)
class AntennaPipeline:
    """One pipeline this worker serves, as Antenna knows it."""

    slug: str
    description: str
    algorithms: tuple[Algorithm, ...]
    title: str = ""  # Antenna's pipeline name; the slug when empty
    version: int = 1

    def keys(self) -> dict[str, str]:
        """Our stage key -> its Antenna key."""
        return {a.key: antenna_key(a) for a in self.algorithms}

    def classes(self) -> dict[str, int | None]:
        """Antenna key -> the length of its category map (None: a detector, no map)."""
        return {
            antenna_key(a): None if a.task_type == "detection" else len(a.labels)
            for a in self.algorithms
        }

    def config(self) -> dict[str, Any]:
        """Antenna's ``PipelineConfigResponse`` for this pipeline."""
        return {
            "name": self.title or self.slug,
            "slug": self.slug,
            "version": self.version,
            "description": self.description or f"inference-worker pipeline {self.slug}",
            "algorithms": [_algorithm_config(a) for a in self.algorithms],
            "stages": [],
        }


def _algorithm_config(a: Algorithm) -> dict[str, Any]:
    if a.registered is not None:
        return _registered_config(a, a.registered)
    config: dict[str, Any] = {
        "name": a.name,
        "key": antenna_key(a),
        "task_type": _task_type(a),
        "version": 1,
        "version_name": a.weights_sha256[:12],
        "description": f"stage {a.key}, weights sha256 {a.weights_sha256}",
    }
    if a.task_type != "detection":
        config["category_map"] = {
            "data": [{"label": label, "index": i} for i, label in enumerate(a.labels)],
            "labels": list(a.labels),
            "version": a.weights_sha256[:12],
        }
    return config


def _registered_config(a: Algorithm, r: Registered) -> dict[str, Any]:
    """AMI's ``AlgorithmConfigResponse`` as its worker registers it: every field, its category
    map (empty for a detector, which has none) with each category's taxon rank."""
    labels = [] if a.task_type == "detection" else list(a.labels)
    return {
        "name": a.name,
        "key": r.key,
        "description": r.description or None,
        "task_type": _task_type(a),
        "version": r.version,
        "version_name": None,
        "uri": r.uri,
        "category_map": {
            "data": [
                {"index": i, "label": label, "taxon_rank": r.taxon_rank}
                for i, label in enumerate(labels)
            ],
            "labels": labels,
            "version": None,
            "description": None,
            "uri": r.labels_uri,
        },
    }


def error_result(task: Task, message: str) -> dict[str, Any]:
    """Marks the image failed in Antenna (never retried there): always with ``image_id``."""
    return {"error": shorten(scrub(message), _ERROR_CHARS), "image_id": task.image_id}


def ok_result(
    task: Task, response: dict[str, Any], served: AntennaPipeline, slug: str
) -> dict[str, Any]:
    keys = served.keys()
    classes = served.classes()
    detections = []
    for found in response.get("detections") or []:
        algorithm = found["algorithm"]
        renamed = {**algorithm, "key": keys.get(algorithm["key"], algorithm["key"])}
        kept = []
        for entry in found.get("classifications") or []:
            key = keys.get(entry["algorithm"]["key"], entry["algorithm"]["key"])
            if classes.get(key, 0) is None:
                continue  # a detector's own label: no category map in Antenna
            kept.append({**entry, "algorithm": {**entry["algorithm"], "key": key}})
        detections.append(
            {
                **found,
                "source_image_id": task.image_id,
                "algorithm": renamed,
                "classifications": kept,
            }
        )
    return {
        "pipeline": slug,
        "total_time": response.get("total_time", 0.0),
        "source_images": [{"id": task.image_id, "url": redact_url(task.image_url)}],
        "detections": detections,
        "errors": None,
    }


def problems(result: dict[str, Any], task: Task, served: AntennaPipeline, slug: str) -> list[str]:
    """Why Antenna would accept ``result`` and then not save it; empty when it would save it."""
    try:
        parsed = PipelineResults.model_validate(result)
    except pydantic.ValidationError as error:
        return [f"not a PipelineResultsResponse: {shorten(str(error), 300)}"]
    found: list[str] = []
    if parsed.pipeline != slug:
        found.append(f"pipeline {parsed.pipeline!r} is not the job's {slug!r}")
    if [s.id for s in parsed.source_images] != [task.image_id]:
        found.append(
            f"source_images {[s.id for s in parsed.source_images]} is not the task's image"
        )
    classes = served.classes()
    for detection in parsed.detections:
        if detection.source_image_id != task.image_id:
            found.append(f"a detection names image {detection.source_image_id!r}")
        if detection.algorithm.key not in classes:
            found.append(f"algorithm key {detection.algorithm.key!r} is not registered")
        for entry in detection.classifications:
            size = classes.get(entry.algorithm.key, -1)
            if size is None or size < 0:
                found.append(f"classifier key {entry.algorithm.key!r} has no category map")
            elif len(entry.scores) != size:
                found.append(
                    f"{len(entry.scores)} scores for {entry.algorithm.key!r}, whose category map "
                    f"has {size} classes"
                )
    return sorted(set(found))


def item(task: Task, result: dict[str, Any]) -> dict[str, Any]:
    """One entry of a result post."""
    return {"reply_subject": task.reply_subject or "", "result": result}


def encoded(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def fit(
    task: Task, entry: dict[str, Any], max_bytes: int, envelope_bytes: int = ENVELOPE_BYTES
) -> tuple[dict[str, Any], list[str]]:
    """``entry`` as it can be posted alone in a body of at most ``max_bytes`` (of which the
    envelope around it takes ``envelope_bytes``), and the steps taken."""
    steps: list[str] = []
    limit = max_bytes - envelope_bytes
    size = len(encoded(entry))
    if size <= limit or "detections" not in entry["result"]:
        return entry, steps
    for name, step in (("scores_compacted", _compacted), ("logits_rounded", _logits_rounded)):
        entry = {**entry, "result": step(entry["result"])}
        steps.append(name)
        size = len(encoded(entry))
        if size <= limit:
            return entry, steps
    message = (
        f"the result is {size} bytes with scores compacted and logits rounded, over "
        f"{env_name('antenna', 'max_post_bytes')} ({max_bytes})"
    )
    steps.append("error_result")
    return item(task, error_result(task, message)), steps


def _each_classification(result: dict[str, Any], change: Any) -> dict[str, Any]:
    detections = [
        {**d, "classifications": [change(c) for c in d.get("classifications") or []]}
        for d in result["detections"]
    ]
    return {**result, "detections": detections}


def _logits_rounded(result: dict[str, Any]) -> dict[str, Any]:
    """Every logit kept, to 3 decimals: a softmax of them moves by 0.1% at most."""

    def rounded(c: dict[str, Any]) -> dict[str, Any]:
        logits = c.get("logits")
        if not logits:
            return c
        return {**c, "logits": [round(v, _LOGIT_DECIMALS) for v in logits]}

    return _each_classification(result, rounded)


def _cut(score: float, top: float) -> float | int:
    """``score`` cut to 3 decimals: never above it (a float's product can round up a step),
    and below ``top`` unless both are 0; 0 under a thousandth; a non-finite one as it is."""
    if not math.isfinite(score):
        return score
    if 0 <= score < 1 / _SCORE_STEPS:
        return 0
    steps = math.floor(score * _SCORE_STEPS)
    if steps / _SCORE_STEPS > score or steps / _SCORE_STEPS >= top:
        steps -= 1
    return steps / _SCORE_STEPS


def _compact(scores: Sequence[float]) -> list[float | int]:
    """Scores cut (not rounded) to 3 decimals, the top one exact: Antenna's save reads
    ``max(scores)`` and its first index, so every other score stays below the top one."""
    if not scores:
        return []
    top = max(range(len(scores)), key=scores.__getitem__)  # the first of the highest
    out = [_cut(s, scores[top]) for s in scores]
    out[top] = scores[top]
    return out


def _compacted(result: dict[str, Any]) -> dict[str, Any]:
    return _each_classification(result, lambda c: {**c, "scores": _compact(c.get("scores") or [])})
