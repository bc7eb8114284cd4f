"""Whether JetStream answers, the connection up: what a quorum loss tells /readyz, what it
does not (an idle fetch, a refusal, a connection that is down), and the probe that finds it
answering again (the real cluster: tests/integration/test_quorum_lost.py)."""

from __future__ import annotations

import asyncio

import nats
import pytest
from nats.js.errors import APIError, NoStreamResponseError, ServiceUnavailableError

from config.errors import ResultsUnavailable
from config.settings import NatsSettings
from worker.nats.jetstream_health import JetStreamAnswers, unanswered
from worker.nats.result_store import ResultStore


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_what_a_cluster_without_quorum_answers_counts_as_no_answer():
    assert unanswered(ServiceUnavailableError())  # a fetch: no consumer leader
    assert unanswered(nats.errors.TimeoutError())  # a store's PubAck, a consumer info
    assert unanswered(nats.errors.NoRespondersError())  # an ack_sync
    assert unanswered(NoStreamResponseError())
    assert unanswered(APIError(code=503, err_code=10008, description="temporarily unavailable"))


def test_a_refusal_and_a_connection_down_are_not_jetstream_failing():
    assert not unanswered(APIError(code=400, err_code=10077, description="maximum messages"))
    assert not unanswered(APIError(code=404, err_code=10014, description="consumer not found"))
    assert not unanswered(nats.errors.ConnectionReconnectingError())
    assert not unanswered(nats.errors.ConnectionClosedError())


def test_failures_past_the_timeout_are_a_problem_naming_jetstream_until_an_answer():
    clock = Clock()
    answers = JetStreamAnswers(clock)
    answers.failed("fetch", ServiceUnavailableError())
    assert answers.problem(timeout_s=60) is None, "a leader election takes seconds"
    clock.now += 30
    answers.failed("store", nats.errors.TimeoutError())  # the clock runs from the first
    clock.now += 30
    problem = answers.problem(timeout_s=60)
    assert problem is not None and "JetStream" in problem and "store" in problem, problem
    answers.answered()
    assert answers.problem(timeout_s=60) is None


def test_a_refusal_is_an_answer_and_the_connection_s_errors_leave_the_clock_alone():
    clock = Clock()
    answers = JetStreamAnswers(clock)
    answers.failed("store", nats.errors.ConnectionReconnectingError())
    assert answers.failing_since is None
    answers.failed("fetch", ServiceUnavailableError())
    answers.failed("store", APIError(code=400, err_code=10077, description="already stored"))
    clock.now += 120
    assert answers.problem(timeout_s=60) is None


async def test_the_probe_asks_only_while_failing_and_clears_on_an_answer():
    answers = JetStreamAnswers()
    stop = asyncio.Event()
    asked: list[str] = []
    outcomes = [ServiceUnavailableError(), None]

    async def ask() -> None:
        asked.append("consumer info")
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome
        stop.set()

    probing = asyncio.create_task(answers.probe(ask, stop))
    await asyncio.sleep(1.5)
    assert asked == [], "nothing failing: nothing asked"
    answers.failed("fetch", ServiceUnavailableError())
    await asyncio.wait_for(probing, 30)
    assert asked == ["consumer info", "consumer info"]
    assert answers.failing_since is None
    assert answers.last_failure == "consumer info: ServiceUnavailableError"


class QuorumLostJetStream:
    """A results stream with no leader (every publish times out) until ``back``."""

    def __init__(self) -> None:
        self.back = False

    async def publish(self, *_args: object, **_kwargs: object) -> object:
        if not self.back:
            raise nats.errors.TimeoutError
        return type("PubAck", (), {"duplicate": False})()


async def test_a_store_the_stream_cannot_confirm_starts_the_clock_and_one_it_does_clears_it():
    js, answers = QuorumLostJetStream(), JetStreamAnswers()
    n = NatsSettings()
    store = ResultStore(
        js,  # type: ignore[arg-type]
        answers=answers,
        stream=n.results_stream,
        objects=n.result_objects,
        publish_timeout_s=n.publish_timeout_s,
    )
    result = {"job_id": "job", "task_id": "task", "response": None}
    with pytest.raises(ResultsUnavailable):  # no PubAck: not taken as stored
        await store.store(result)
    assert answers.failing_since is not None and answers.last_failure.startswith("store")
    js.back = True
    assert await store.store(result) is True
    assert answers.failing_since is None
