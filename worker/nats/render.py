"""A ``Result`` as the NATS source keeps it: the stored result document of the SPEC's result
schema, published on the results stream (``worker.nats.result_store``). An ``ok`` one carries
Antenna's ``PipelineResultsResponse`` for its image in ``response``."""

from __future__ import annotations

from typing import Any

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
        "response": result.response(),
        "error": failure.as_dict() if failure is not None else None,
        "model": result.model,
        "timings_s": {name: round(s, 6) for name, s in result.timings_s.items()},
        "worker": result.worker,
        "attempt": result.attempt,
        "reply_subject": task.reply_subject,
    }
