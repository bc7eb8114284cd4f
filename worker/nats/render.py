"""A ``Result`` as the NATS source keeps it: the stored result document of the SPEC's result
schema, published on the results stream (``worker.nats.result_store``). An ``ok`` one carries
Antenna's ``PipelineResultsResponse`` for its image in ``response``: its detections in the
shape ``pipelines.found`` writes, under our stage keys, its image's URL without credentials
or query."""

from __future__ import annotations

from typing import Any

from config.redact import redact_url
from pipelines.found import fields
from worker.core.results import Result


def document(result: Result) -> dict[str, Any]:
    task = result.task
    failure = result.final_failure()
    return {
        "task_id": task.id,
        "job_id": task.job_id,
        "image_id": task.image_id,
        "pipeline": task.pipeline,
        "status": "error" if failure is not None else "ok",
        "response": response(result),
        "error": failure.as_dict() if failure is not None else None,
        "model": result.model,
        "timings_s": {name: round(s, 6) for name, s in result.timings_s.items()},
        "worker": result.worker,
        "attempt": result.attempt,
        "reply_subject": task.reply_subject,
    }


def response(result: Result) -> dict[str, Any] | None:
    """An ok result's ``PipelineResultsResponse``; None for an error."""
    if result.failure is not None:
        return None
    task = result.task
    image_id = task.image_id
    return {
        "pipeline": task.pipeline,
        "total_time": result.total_s(),
        "source_images": [{"id": image_id, "url": redact_url(task.image_url)}],
        "detections": [fields(found, image_id) for found in result.detections or []],
        "errors": None,
    }
