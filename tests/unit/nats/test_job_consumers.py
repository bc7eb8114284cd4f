"""The job consumers handed out for a fetch: never those of a pipeline unavailable here."""

from __future__ import annotations

from types import SimpleNamespace

from config.settings import NatsSettings
from worker.nats.job_consumers import BoundJob, JobConsumers


def bound(pipeline: str, job: str) -> BoundJob:
    subject = f"tasks.{pipeline}.{job}"
    return BoundJob(subject, f"c-{job}", 5, 0, pipeline=pipeline, sub=SimpleNamespace())


def test_no_job_of_a_pipeline_that_cannot_be_loaded_here_is_pulled_from():
    consumers = JobConsumers(SimpleNamespace(), NatsSettings(), ["moths", "orders"])  # type: ignore[arg-type]
    for job in (bound("moths", "j1"), bound("orders", "j2"), bound("moths", "j3")):
        consumers._jobs[job.subject] = job  # as a discovery binds them
    available = lambda pipeline: pipeline != "orders"  # noqa: E731

    for _ in range(3):  # whichever job's turn it is
        handed = consumers.active(available=available)
        assert sorted(job.name for job in handed) == ["c-j1", "c-j3"]
    # unlike ``runnable`` (a preference), no fallback to it when nothing else has work
    assert consumers.active(available=lambda pipeline: pipeline == "none") == []
    assert len(consumers.active()) == 3
