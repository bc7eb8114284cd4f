"""Making job consumers within the bound (``worker.nats.consumer_maker``)."""

from __future__ import annotations

import datetime
from functools import partial

from nats.js import api
from nats.js.errors import APIError, NotFoundError

from config.settings import NatsSettings
from worker.nats.consumer_maker import ConsumerMaker
from worker.nats.job_state import JobConsumerState
from worker.nats.provision import job_consumer_config


class FakeJetStream:
    """Makes every consumer asked for, or refuses each (none then exists)."""

    def __init__(self, refuses: bool = False) -> None:
        self.refuses = refuses
        self.made: list[str] = []

    async def add_consumer(self, stream: str, config: api.ConsumerConfig) -> api.ConsumerInfo:
        if self.refuses:
            raise APIError(code=400, description="maximum consumers limit reached", err_code=1)
        self.made.append(config.name or "")
        now = datetime.datetime.now(datetime.UTC)
        return api.ConsumerInfo(
            name=config.name or "", stream_name=stream, config=config, created=now
        )

    async def consumer_info(self, stream: str, name: str) -> api.ConsumerInfo:
        raise NotFoundError()


def maker(js: FakeJetStream, bound: int) -> tuple[ConsumerMaker, JobConsumerState]:
    state = JobConsumerState(bound=bound)
    n = NatsSettings(consumer="w")
    config_of = partial(job_consumer_config, n)
    made = ConsumerMaker(
        js,  # type: ignore[arg-type]
        state,
        stream=n.tasks_stream,
        config_of=config_of,
        most=n.max_job_consumers,
    )
    return made, state


async def test_consumers_are_made_until_the_bound_counting_those_that_exist():
    js = FakeJetStream()
    make, state = maker(js, bound=3)
    state.unlisted({}, others=1)
    made = [await make.make(f"tasks.p.job-{i}") for i in range(3)]
    assert made == [True, True, False]
    assert len(js.made) == 2 and state.stats.made == 2


async def test_a_refusal_is_counted_and_said_until_a_consumer_is_made():
    js = FakeJetStream(refuses=True)
    make, state = maker(js, bound=10)
    assert not await make.make("tasks.p.job-1")
    assert state.stats.refused == 1 and "maximum consumers" in (state.refusal or "")
    js.refuses = False
    assert await make.make("tasks.p.job-1")
    assert state.refusal is None and state.stats.made == 1


async def test_a_remake_owed_is_made_from_where_the_deleted_one_stopped():
    js = FakeJetStream()
    make, state = maker(js, bound=10)
    state.owe("tasks.p.job-1", 42)
    await make.make_owed()
    (info,) = state.consumers.values()
    assert state.owed() == [] and info.config.opt_start_seq == 42
    assert info.config.deliver_policy == api.DeliverPolicy.BY_START_SEQUENCE
