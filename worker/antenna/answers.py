"""What each of Antenna's endpoints must answer with a 2xx, as the worker reads it: field names
and types from Antenna's serializers and schemas (RolnickLab/antenna ``ami/jobs/views.py``,
``ami/jobs/serializers.py``, ``ami/ml/schemas.py``: ``MLJobTasksResponseSerializer``,
``PipelineProcessingTask``, ``MLJobResultsResponseSerializer``). Strict about the fields the
worker uses, tolerant of extra ones. A 2xx whose body does not fit is not an answer (the
client raises ``BadAnswer`` naming the field), except for the tasks of a reservation: Antenna
reserved every one of them, so each is checked on its own (``task_problem``) and one bad task
does not lose the others. Imports nothing of ours.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import pydantic

# A NATS subject: printable ASCII, no spaces (a non-ASCII digit such as '²' is not a digit here).
Subject = Annotated[str, pydantic.StringConstraints(pattern=r"^[!-~]*$", max_length=1024)]


class _Answer(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")


class ListedJob(_Answer):
    id: pydantic.StrictInt
    pipeline_slug: str | None = None


class JobsPage(_Answer):
    """``GET jobs/`` (a DRF page)."""

    count: pydantic.StrictInt | None = None
    next: str | None = None
    results: list[ListedJob]


class JobDetail(_Answer):
    """``GET jobs/{id}/``."""

    status: str | None = None
    pipeline_slug: str | None = None


class ReservedTask(_Answer):
    """``PipelineProcessingTask``."""

    id: str
    image_id: str
    image_url: str
    reply_subject: Subject | None = None


class Reserved(_Answer):
    """``POST jobs/{id}/tasks/``: ``MLJobTasksResponseSerializer``; the envelope only (each task
    is a ``ReservedTask``, checked on its own by the source)."""

    tasks: list[Any]


_USABLE_SUBJECT = pydantic.TypeAdapter(
    Annotated[str, pydantic.StringConstraints(pattern=r"^[!-~]+$", max_length=1024)]
)


def task_problem(task: object) -> str | None:
    """Why one reserved task is not a ``ReservedTask``, by field; None when it is one."""
    try:
        ReservedTask.model_validate(task)
    except pydantic.ValidationError as error:
        return wrong_fields(error)
    return None


def usable_reply_subject(value: object) -> str | None:
    """``value`` when a result can be posted to it (one NATS subject), else None: a result
    without one is never acked by Antenna."""
    try:
        return _USABLE_SUBJECT.validate_python(value, strict=True)
    except pydantic.ValidationError:
        return None


def wrong_fields(error: pydantic.ValidationError) -> str:
    """The fields that are wrong, by path, with what was wrong (no values: they may be long)."""
    parts = []
    for problem in error.errors()[:3]:
        path = ".".join(str(p) for p in problem["loc"]) or "the body"
        parts.append(f"{path}: {problem['msg']}")
    more = error.error_count() - len(parts)
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


class QueuedResult(_Answer):
    reply_subject: str
    status: str


class ResultsAccepted(_Answer):
    """``POST jobs/{id}/result/``: ``MLJobResultsResponseSerializer``; Antenna answers 200
    only once every result in the body is queued."""

    status: Literal["accepted"]
    job_id: pydantic.StrictInt
    results_queued: pydantic.StrictInt
    tasks: list[QueuedResult] = []


class Registered(_Answer):
    """``POST projects/{id}/pipelines/``."""

    pipelines_created: list[str] | None = None


class ListedPipeline(_Answer):
    slug: str


class PipelinesPage(_Answer):
    """``GET projects/{id}/pipelines/``."""

    results: list[ListedPipeline]


BY_ENDPOINT: dict[str, type[pydantic.BaseModel]] = {
    "jobs": JobsPage,
    "job": JobDetail,
    "tasks": Reserved,
    "result": ResultsAccepted,
    "register": Registered,
    "pipelines": PipelinesPage,
}
