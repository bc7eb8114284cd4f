"""Repairing job consumers' drifted delivery settings (``worker.nats.drift_repair``): one
loop, and a policy table saying what start and each discovery do on each outcome."""

from __future__ import annotations

import datetime
from dataclasses import replace
from functools import partial

import pytest
from nats.js import api
from nats.js.errors import APIError
from structlog.testing import capture_logs

from config.settings import ConfigError, NatsSettings
from worker.nats.drift_repair import POLICY, Action, Caller, Drift, DriftRepair
from worker.nats.job_state import JobConsumerState
from worker.nats.provision import job_consumer_config

SUBJECT = "tasks.p.job-1"


class FakeJetStream:
    """Takes every update, or refuses each with a 400."""

    def __init__(self, refuses: bool = False) -> None:
        self.refuses = refuses
        self.updates: list[api.ConsumerConfig] = []

    async def add_consumer(self, stream: str, config: api.ConsumerConfig) -> api.ConsumerInfo:
        if self.refuses:
            raise APIError(code=400, description="consumer update not allowed", err_code=10012)
        self.updates.append(config)
        return info_of(config)


def info_of(config: api.ConsumerConfig) -> api.ConsumerInfo:
    now = datetime.datetime.now(datetime.UTC)
    return api.ConsumerInfo(name=config.name or "", stream_name="t", config=config, created=now)


def drifted(n: NatsSettings) -> dict[str, api.ConsumerInfo]:
    """One job consumer made by a process with a shorter ack wait and fewer deliveries."""
    config = replace(job_consumer_config(n, SUBJECT), ack_wait=5.0, max_deliver=1)
    return {config.name or "": info_of(config)}


def repair(refuses: bool = False) -> tuple[DriftRepair, FakeJetStream, JobConsumerState]:
    js, state = FakeJetStream(refuses), JobConsumerState(bound=10)
    n = NatsSettings(consumer="w")
    config_of = partial(job_consumer_config, n)
    drift = DriftRepair(js, state, stream=n.tasks_stream, config_of=config_of)  # type: ignore[arg-type]
    return drift, js, state


def test_the_policy_says_what_each_caller_does_on_each_outcome():
    assert POLICY == {
        Drift.FOUND: {Caller.OPEN: Action.NOTHING, Caller.DISCOVERY: Action.WARN_ONCE},
        Drift.UPDATED: {Caller.OPEN: Action.LOG_UPDATED, Caller.DISCOVERY: Action.COUNT},
        Drift.REFUSED: {Caller.OPEN: Action.EXIT, Caller.DISCOVERY: Action.WARN_AND_KEEP},
    }


async def test_at_start_a_drifted_consumer_is_updated_and_logged_not_counted():
    drift, _, state = repair()
    n = NatsSettings(consumer="w")
    ours = drifted(n)
    with capture_logs() as logs:
        updated = await drift.repair(ours, Caller.OPEN)
    (info,) = updated.values()
    wanted = job_consumer_config(n, SUBJECT)
    assert (info.config.ack_wait, info.config.max_deliver) == (wanted.ack_wait, wanted.max_deliver)
    assert [entry["event"] for entry in logs] == ["job_consumer_updated"]
    assert state.stats.updated == 0


async def test_at_start_a_refused_update_ends_the_start_naming_the_consumer():
    drift, _, _ = repair(refuses=True)
    ours = drifted(NatsSettings(consumer="w"))
    with pytest.raises(ConfigError, match=next(iter(ours))) as raised:
        await drift.repair(ours, Caller.OPEN)
    assert "consumer update not allowed" in str(raised.value)


async def test_at_discovery_a_drifted_consumer_is_said_once_updated_and_counted_each_time():
    drift, js, state = repair()
    n = NatsSettings(consumer="w")
    with capture_logs() as logs:
        for _ in range(2):
            await drift.repair(drifted(n), Caller.DISCOVERY)
    assert [entry["event"] for entry in logs] == ["job_consumer_settings_differ"]
    assert len(js.updates) == 2 and state.stats.updated == 2


async def test_at_discovery_a_refused_update_is_logged_and_the_consumer_left_as_it_is():
    drift, _, state = repair(refuses=True)
    ours = drifted(NatsSettings(consumer="w"))
    before = dict(ours)
    with capture_logs() as logs:
        updated = await drift.repair(ours, Caller.DISCOVERY)
    events = [entry["event"] for entry in logs]
    assert events == ["job_consumer_settings_differ", "job_consumer_not_updated"]
    assert ours == before and updated == {} and state.stats.updated == 0


async def test_a_consumer_with_our_settings_is_left_alone_by_both_callers():
    drift, js, state = repair(refuses=True)
    n = NatsSettings(consumer="w")
    config = job_consumer_config(n, SUBJECT)
    for caller in Caller:
        with capture_logs() as logs:
            await drift.repair({config.name or "": info_of(config)}, caller)
        assert logs == []
    assert js.updates == [] and state.stats.updated == 0
