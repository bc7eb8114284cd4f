"""Subject matching for the advisory check (``worker.nats.advisories``)."""

from __future__ import annotations

from worker.nats.advisories import _matches


def test_subject_matching_follows_nats_wildcards():
    assert _matches("tasks.p.job-1", "tasks.p.job-1")
    assert not _matches("tasks.p.job-2", "tasks.p.job-1")
    assert _matches("tasks.p.*", "tasks.p.job-1") and not _matches("tasks.p.*", "tasks.p")
    assert _matches("tasks.>", "tasks.p.job-1") and not _matches("tasks.>", "tasks")
    assert not _matches("tasks.p", "tasks.p.job-1")
