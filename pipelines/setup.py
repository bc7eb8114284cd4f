"""The pipeline these settings ask for, checked before anything is loaded: its stages'
weights exist, the bytes cap holds a batch of the largest images it can load, and the models'
memory budget holds each pipeline alone (``budget_bytes``: the one place it is worked out)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from config.cross_checks import memory_problems, weights_problems
from config.errors import ConfigError
from config.names import env_name
from config.settings import Settings
from datasets.images import DecodePlan
from pipelines.declare import Pipeline
from pipelines.device import default_budget_bytes
from pipelines.models import resolve_device
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
    """ConfigError with one line per problem when the pipeline cannot be served (the first
    of ``WORKER_MODEL__PIPELINES`` when several are)."""
    return choose_all(s)[0]


def choose_all(s: Settings) -> list[Chosen]:
    """Every pipeline the process serves, resolved and checked (weights there, names
    distinct, the bytes cap holding a batch of the largest images any of them loads);
    ConfigError with one line per problem."""
    chosen: list[Chosen] = []
    problems: list[str] = []
    for entry in s.model.pipeline_entries():
        try:
            pipeline = resolve(entry, s.model.weights, s.model.files_mirror)
        except ConfigError as error:
            problems.extend(str(error).splitlines())
            continue
        if any(c.pipeline.name == pipeline.name for c in chosen):
            problems.append(
                f"{env_name('model', 'pipelines')}: {entry!r} names pipeline "
                f"{pipeline.name!r} again"
            )
            continue
        problems += [
            line
            for stage in pipeline.stages()
            if isinstance(stage.weights, str)
            for line in weights_problems(stage.weights, f"weights of stage {stage.key!r}")
        ]
        chosen.append(_chosen(s, pipeline))
    if chosen:
        problems += memory_problems(s, max(c.plan.max_image_bytes() for c in chosen))
    if problems:
        raise ConfigError("\n".join(problems))
    return chosen


def estimated_bytes(pipeline: Pipeline) -> int:
    """What a pipeline's models take loaded, as far as can be told without loading them: the
    size of its local weights files (a state_dict is its tensors' bytes); weights on S3 or
    built by code count 0 until their first load measures them."""
    total = 0
    for stage in pipeline.stages():
        if isinstance(stage.weights, str) and "://" not in stage.weights.removeprefix("file://"):
            path = Path(stage.weights.removeprefix("file://"))
            total += path.stat().st_size if path.is_file() else 0
    return total


def budget_bytes(s: Settings, device: str, chosen: list[Chosen]) -> int:
    """The models' memory budget (``WORKER_MODEL__MEMORY_BUDGET_BYTES``, else derived from the
    device), which the model cache (``pipelines.cache``) keeps; ConfigError when a pipeline
    cannot fit it alone."""
    budget = s.model.memory_budget_bytes or default_budget_bytes(resolve_device(device))
    problems = budget_problems(s, chosen, budget)
    if problems:
        raise ConfigError("\n".join(problems))
    return budget


def budget_problems(s: Settings, chosen: list[Chosen], budget_bytes: int) -> list[str]:
    """A pipeline that cannot fit the memory budget even alone cannot be served."""
    return [
        f"pipeline {c.pipeline.name!r} needs about {size} bytes for its models, over "
        f"{env_name('model', 'memory_budget_bytes')} ({budget_bytes}"
        f"{'' if s.model.memory_budget_bytes else ', derived from the device'})"
        for c in chosen
        if (size := estimated_bytes(c.pipeline)) > budget_bytes
    ]


def _chosen(s: Settings, pipeline: Pipeline) -> Chosen:
    plan = decode_plan(
        pipeline,
        s.loader.max_side,
        s.loader.fast_decode,
        s.loader.device_decode,
        exact=s.loader.exact_decode,
        max_pixels=s.loader.max_pixels,
    )
    limits = DeviceLimits(
        detector_batch=s.model.detector_batch_size,
        crop_batch=s.model.crop_batch_size,
        max_side=s.loader.max_side,
        max_pixels=plan.max_pixels,
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
