"""The new-jobs messages kept in hand (``worker.nats.job_discovery``)."""

from __future__ import annotations

from types import SimpleNamespace

from config.settings import NatsSettings
from worker.nats.job_discovery import JobDiscovery
from worker.nats.provision import consumer_names

SUBJECT = "tasks.p.job-1"


class FakeMsg:
    def __init__(self, subject: str, seq: int) -> None:
        self.subject = subject
        self.metadata = SimpleNamespace(sequence=SimpleNamespace(stream=seq))
        self.settled: list[str] = []

    async def ack(self) -> None:
        self.settled.append("ack")

    async def nak(self) -> None:
        self.settled.append("nak")


def discovery() -> JobDiscovery:
    n = NatsSettings(consumer="w")
    return JobDiscovery(None, consumer_names(n), fetch_timeout_s=n.fetch_timeout_s)  # type: ignore[arg-type]


async def test_only_a_jobs_latest_message_is_kept_in_hand_the_older_ones_acked():
    hand = discovery()
    first, latest, late = FakeMsg(SUBJECT, 3), FakeMsg(SUBJECT, 7), FakeMsg(SUBJECT, 5)
    for msg in (first, latest, late):
        await hand.keep(msg)
    assert hand.waiting() == [SUBJECT] and hand.in_hand(SUBJECT)
    assert first.settled == ["ack"] and late.settled == ["ack"] and latest.settled == []


async def test_a_task_fetched_past_a_held_message_settles_it_and_close_gives_back_the_rest():
    hand = discovery()
    held, waiting = FakeMsg(SUBJECT, 4), FakeMsg("tasks.p.job-2", 9)
    await hand.keep(held)
    hand.consumer_made(SUBJECT)  # held now, until its consumer is past it
    await hand.keep(waiting)
    await hand.delivered([FakeMsg(SUBJECT, 4)])  # type: ignore[list-item]
    await hand.close()
    assert held.settled == ["ack"] and waiting.settled == ["nak"]
    assert not hand.in_hand(SUBJECT) and not hand.in_hand("tasks.p.job-2")


async def test_a_failed_discovery_gives_back_only_what_it_did_not_take_in_hand():
    hand = discovery()
    kept, other = FakeMsg(SUBJECT, 1), FakeMsg("tasks.p.job-2", 2)
    await hand.keep(kept)
    await hand.give_back([kept, other])  # type: ignore[list-item]
    assert kept.settled == [] and other.settled == ["nak"]
