"""The shared consumer's filter says which FAIR_JOBS made it (``worker.nats.provision``)."""

from __future__ import annotations

from nats.js import api

from worker.nats.provision import serves_job_subjects


def test_the_shared_consumers_filter_says_which_fair_jobs_made_it():
    fair = api.ConsumerConfig(filter_subjects=["tasks.p", "tasks.q"])
    stream_order = api.ConsumerConfig(filter_subjects=["tasks.p", "tasks.p.*"])
    single = api.ConsumerConfig(filter_subject="tasks.p.*")
    assert not serves_job_subjects(fair)
    assert serves_job_subjects(stream_order) and serves_job_subjects(single)
