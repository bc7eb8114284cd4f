"""What this worker posts to Antenna for one task, and what it registers: one module, so the
keys registered are the keys results name.

- Keys: an algorithm's Antenna key is its stage key and the first 12 hex digits of its weights'
  sha256 (``antenna_key``). Antenna's keys are global and write-once, so changed weights
  register, and answer under, a new key. A stage whose publisher fixed its identity
  (``Registered``: AMI's catalogue) registers and answers under that key, name, description
  and URIs verbatim, as AMI's own worker does.
- ``ok_entry``: a ``Result``'s typed detections as Antenna's ``PipelineResultsResponse``
  (fields as ``pipelines.found`` writes them), with ``pipeline`` the job's slug,
  ``source_images`` the task's image, and algorithm references under their Antenna keys,
  encoded once, here (the poster sends those bytes as they are). A detector alone writes its
  label as a one-score classification; Antenna registers a detector without a category map, so
  that classification is left out (the box is kept).
- ``problems``: everything that would make Antenna accept a result and then not save it, checked
  against what this worker registers; such a result is replaced by ``error_result``.
- ``fit``: a result over the post size cap (measured on its encoded parts; each step writes
  again only the vectors it changes) has its scores compacted (cut to 3 decimals, below
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
from dataclasses import dataclass, replace
from typing import Any

from config.names import env_name
from config.redact import redact_url, scrub, shorten
from pipelines.declare import Registered
from pipelines.found import Classification, detection_head, head_fields, tail_fields
from pipelines.models import Algorithm
from worker.core.results import Result
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


def item(task: Task, result: dict[str, Any]) -> dict[str, Any]:
    """One entry of a result post."""
    return {"reply_subject": task.reply_subject or "", "result": result}


_ENCODER = json.JSONEncoder(separators=(",", ":"))


def encoded(value: Any) -> bytes:
    return _ENCODER.encode(value).encode()


@dataclass(frozen=True)
class Entry:
    """One entry of a result post, encoded once: what the poster sends (``body``), how many
    detections it keeps, and an error result's message (None for an ok result)."""

    body: bytes
    detections: int = 0
    error: str | None = None


def error_entry(task: Task, message: str) -> Entry:
    result = error_result(task, message)
    return Entry(encoded(item(task, result)), error=result["error"])


@dataclass
class OkEntry:
    """An ok result's entry, its text in parts: each kept classification's ``scores`` and
    ``logits`` a part of their own, so that making it smaller (``fit``) writes those again
    and nothing else. ``"".join(parts)`` is the entry's compact JSON; ASCII (JSON's escapes),
    so its length is its size in bytes."""

    parts: list[str]
    vectors: list[tuple[int, Classification]]  # the part of each classification's scores
    detections: int

    def size(self) -> int:
        return sum(len(part) for part in self.parts)

    def entry(self) -> Entry:
        return Entry("".join(self.parts).encode(), self.detections)


def _members(value: dict[str, Any]) -> str:
    """A JSON object's members, without its braces."""
    return _ENCODER.encode(value)[1:-1]


def ok_entry(task: Task, result: Result, served: AntennaPipeline, slug: str) -> OkEntry:
    """``result`` as Antenna's ``PipelineResultsResponse`` in an entry of the post: ``pipeline``
    the job's slug, ``source_images`` the task's image, every algorithm under its Antenna key,
    a detector's own label left out (Antenna has no category map for it)."""
    keys, classes = served.keys(), served.classes()
    image_id = task.image_id
    envelope = {
        "pipeline": slug,
        "total_time": result.total_s(),
        "source_images": [{"id": image_id, "url": redact_url(task.image_url)}],
    }
    reply = _ENCODER.encode(task.reply_subject or "")
    parts = [f'{{"reply_subject":{reply},"result":{{{_members(envelope)},"detections":[']
    vectors: list[tuple[int, Classification]] = []
    found = result.detections or []
    for index, detection in enumerate(found):
        key = keys.get(detection.algorithm.key, detection.algorithm.key)
        head = _members(detection_head(detection, image_id, key))
        parts.append(f'{"," if index else ""}{{{head},"classifications":[')
        kept = 0
        for c in detection.classifications:
            key = keys.get(c.algorithm.key, c.algorithm.key)
            if classes.get(key, 0) is None:
                continue  # a detector's own label: no category map in Antenna
            parts.append(f'{"," if kept else ""}{{{_members(head_fields(c))},"scores":')
            vectors.append((len(parts), c))
            parts += [_ENCODER.encode(c.scores), ',"logits":', _ENCODER.encode(c.logits)]
            parts.append(f",{_members(tail_fields(c, key))}}}")
            kept += 1
        parts.append("]}")
    parts.append('],"errors":null}}')
    return OkEntry(parts, vectors, len(found))


def problems(result: Result, served: AntennaPipeline) -> list[str]:
    """Why Antenna would accept ``result`` and then not save it; empty when it would save it.
    (Its pipeline, image and types are the entry's own: ``ok_entry`` writes them.)"""
    keys, classes = served.keys(), served.classes()
    found: list[str] = []
    for detection in result.detections or []:
        key = keys.get(detection.algorithm.key, detection.algorithm.key)
        if key not in classes:
            found.append(f"algorithm key {key!r} is not registered")
        for entry in detection.classifications:
            key = keys.get(entry.algorithm.key, entry.algorithm.key)
            size = classes.get(key, -1)
            if size is None:
                continue  # a detector's own label: left out of the entry
            if size < 0:
                found.append(f"classifier key {key!r} has no category map")
            elif len(entry.scores) != size:
                found.append(
                    f"{len(entry.scores)} scores for {key!r}, whose category map has {size} classes"
                )
    return sorted(set(found))


def fit(
    task: Task, entry: Entry | OkEntry, max_bytes: int, envelope_bytes: int = ENVELOPE_BYTES
) -> tuple[Entry, list[str]]:
    """``entry`` as it can be posted alone in a body of at most ``max_bytes`` (of which the
    envelope around it takes ``envelope_bytes``), and the steps taken. Each step writes again
    only the vectors it changes."""
    if isinstance(entry, Entry):
        return entry, []  # an error result: as it is
    steps: list[str] = []
    limit = max_bytes - envelope_bytes
    size = entry.size()
    if size <= limit:
        return entry.entry(), steps
    entry = replace(entry, parts=list(entry.parts))  # the steps write parts: not the caller's
    for name, step in (("scores_compacted", _compacted), ("logits_rounded", _logits_rounded)):
        size += step(entry)
        steps.append(name)
        if size <= limit:
            return entry.entry(), steps
    message = (
        f"the result is {size} bytes with scores compacted and logits rounded, over "
        f"{env_name('antenna', 'max_post_bytes')} ({max_bytes})"
    )
    steps.append("error_result")
    return error_entry(task, message), steps


def _compacted(entry: OkEntry) -> int:
    """Every classification's scores compacted (``_compact``); the bytes it took off (< 0)."""
    change = 0
    for at, c in entry.vectors:
        written = _ENCODER.encode(_compact(c.scores))
        change += len(written) - len(entry.parts[at])
        entry.parts[at] = written
    return change


def _logits_rounded(entry: OkEntry) -> int:
    """Every logit kept, to 3 decimals: a softmax of them moves by 0.1% at most."""
    change = 0
    for at, c in entry.vectors:
        if not c.logits:
            continue
        written = _ENCODER.encode([round(v, _LOGIT_DECIMALS) for v in c.logits])
        change += len(written) - len(entry.parts[at + 2])
        entry.parts[at + 2] = written
    return change


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
