"""The pure rules behind job consumers: which shared-consumer filter means which
FAIR_JOBS, and subject matching for the advisory check."""

from __future__ import annotations

from nats.js import api

from worker.nats.advisories import _matches
from worker.nats.provision import serves_job_subjects


def test_the_shared_consumers_filter_says_which_fair_jobs_made_it():
    fair = api.ConsumerConfig(filter_subjects=["tasks.p", "tasks.q"])
    stream_order = api.ConsumerConfig(filter_subjects=["tasks.p", "tasks.p.*"])
    single = api.ConsumerConfig(filter_subject="tasks.p.*")
    assert not serves_job_subjects(fair)
    assert serves_job_subjects(stream_order) and serves_job_subjects(single)


def test_subject_matching_follows_nats_wildcards():
    assert _matches("tasks.p.job-1", "tasks.p.job-1")
    assert not _matches("tasks.p.job-2", "tasks.p.job-1")
    assert _matches("tasks.p.*", "tasks.p.job-1") and not _matches("tasks.p.*", "tasks.p")
    assert _matches("tasks.>", "tasks.p.job-1") and not _matches("tasks.>", "tasks")
    assert not _matches("tasks.p", "tasks.p.job-1")
