"""The pipeline these settings ask for, checked before anything is loaded: its stages'
weights exist, and the bytes cap holds a batch of the largest images it can load."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from config.errors import ConfigError
from config.rules import memory_problems, weights_problems
from config.settings import Settings
from datasets.images import DecodePlan
from pipelines.declare import Pipeline
from pipelines.registry import resolve
from pipelines.response import ResponseFormat
from pipelines.runner import DeviceLimits, Runner, decode_plan


@dataclass(frozen=True)
class Chosen:
    pipeline: Pipeline
    plan: DecodePlan
    limits: DeviceLimits
    response_format: ResponseFormat


def choose(s: Settings) -> Chosen:
    """ConfigError with one line per problem when the pipeline cannot be served."""
    pipeline = resolve(s.model.pipeline, s.model.weights)
    plan = decode_plan(
        pipeline,
        s.loader.max_side,
        s.loader.fast_decode,
        s.loader.device_decode,
        exact=s.loader.exact_decode,
    )
    problems = [
        line
        for stage in pipeline.stages()
        if isinstance(stage.weights, str)
        for line in weights_problems(stage.weights, f"weights of stage {stage.key!r}")
    ]
    problems += memory_problems(s, plan.max_image_bytes())
    if problems:
        raise ConfigError("\n".join(problems))
    limits = DeviceLimits(
        detector_batch=s.model.detector_batch_size,
        crop_batch=s.model.crop_batch_size,
        max_side=s.loader.max_side,
    )
    fmt = ResponseFormat(s.model.scores, s.model.top_k, s.model.labels_inline_max)
    return Chosen(pipeline, plan, limits, fmt)


def model_info(runner: Runner) -> dict[str, Any]:
    """The result's ``model``: the pipeline, one sha256 over its stages' weights (a single
    stage's own sha256), and each stage's."""
    algorithms = runner.algorithms()
    if len(algorithms) == 1:
        combined = algorithms[0].weights_sha256
    else:
        joined = ";".join(f"{a.key}={a.weights_sha256}" for a in algorithms)
        combined = hashlib.sha256(joined.encode()).hexdigest()
    return {
        "name": runner.pipeline.name,
        "weights_sha256": combined,
        "stages": [
            {"key": a.key, "task_type": a.task_type, "weights_sha256": a.weights_sha256}
            for a in algorithms
        ],
    }
