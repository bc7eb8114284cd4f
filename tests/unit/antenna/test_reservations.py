"""Reserving tasks from Antenna (`worker.antenna.reservations`): TTRs, lost and late answers,
how much is reserved, against the fake Antenna."""

from __future__ import annotations

import asyncio
import time

import pytest
import structlog
from pydantic import SecretStr

from tests.antenna_fake import FakeAntenna
from tests.unit.antenna.common import (
    SERVED,
    SLUG,
    TOKEN,
    client_of,
    images,
    outcome,
    reserve_all,
    rules_of,
    source_of,
    task_of,
)
from worker.antenna.client import AntennaClient
from worker.antenna.job_listing import JobRotation
from worker.antenna.parts import NoResultsLookup
from worker.antenna.reservations import Reservations, delivered_of
from worker.antenna.source import AntennaSource
from worker.core.admission import Admission
from worker.core.claims import Claims
from worker.core.results import ResultMaker
from worker.health.liveness import Liveness


async def test_a_reservation_runs_out_after_its_ttr_and_a_task_comes_back_once(
    fake: FakeAntenna,
) -> None:
    job = fake.add_job(SLUG, images(3))
    source = source_of(fake)
    first = await reserve_all(source, 3)
    assert [d.delivered for d in first] == [1, 1, 1]
    assert await source.fetch(3) == []  # all reserved: Antenna answers []
    fake.expire_reservations()
    second = await reserve_all(source, 3)
    assert {d.handle.image_id for d in second} == {"i0", "i1", "i2"}
    assert [d.delivered for d in second] == [2, 2, 2]
    fake.expire_reservations()
    assert await source.fetch(3) == []
    assert fake.lost(job) == {"i0", "i1", "i2"}


async def test_one_bad_task_in_a_reservation_gets_an_error_result_and_the_rest_are_served(
    fake: FakeAntenna,
) -> None:
    job = fake.add_job(SLUG, images(6))
    fake.spoil("i1", lambda t: {**t, "image_url": None})
    fake.spoil("i2", lambda t: {**t, "id": None})  # no id; its image and subject still usable
    fake.spoil("i3", lambda t: {**t, "reply_subject": t["reply_subject"] + "\u00b2"}, times=1)
    fake.spoil("i4", lambda t: ["not", "a", "task"], times=1)
    source = source_of(fake)
    rules = rules_of(fake, 10**6)
    claims = Claims(100, Liveness(60.0), rules.settler)
    admission = Admission(rules.settler, NoResultsLookup(), claims, ResultMaker())

    with structlog.testing.capture_logs() as logs:
        got = await source.fetch(6)
        held = [c for c in await asyncio.gather(*map(admission.admit, got)) if c is not None]
    verdicts = await asyncio.gather(*(rules.settle(c.task, c.delivered, outcome()) for c in held))

    assert sorted(d.handle.image_id for d in got) == ["i0", "i1", "i2", "i5"]
    assert sorted(c.task.image_id for c in held) == ["i0", "i5"] and verdicts == ["ok", "ok"]
    assert fake.jobs[job].done == {"i0", "i5"} and fake.jobs[job].failed == {"i1", "i2"}
    skipped = [e for e in logs if e["event"] == "antenna_task_skipped"]
    assert [(e["job_id"], e["image_id"]) for e in skipped] == [(job, "i3"), (job, None)]
    # The two skipped come back once their reservations run out, and are served then.
    fake.expire_reservations()
    again = await reserve_all(source, 2)
    assert sorted(d.handle.image_id for d in again) == ["i3", "i4"]
    await asyncio.gather(*(rules.settle(task_of(d), d, outcome()) for d in again))
    assert fake.pending(job) == set() and fake.jobs[job].status == "SUCCESS"


async def test_reserving_nothing_when_antenna_is_down_refuses_or_the_job_is_unknown(
    fake: FakeAntenna,
) -> None:
    job = fake.add_job(SLUG, images(2))
    fake.tasks_unavailable = True
    assert await source_of(fake).fetch(2) == []  # 503: nothing reserved
    assert all(t.delivered == 0 for t in fake.jobs[job].tasks.values())
    fake.tasks_unavailable = False
    wrong = source_of(fake, token="not-the-token")
    assert await wrong.fetch(2) == []
    refusal = str(wrong.refusal())
    assert "401" in refusal and "not-the-token" not in refusal
    fake.tokens["other"] = {2}
    other = source_of(fake, token="other")
    assert await other.fetch(2) == [] and "403" in str(other.refusal())
    unknown = await client_of(fake).post("jobs/999/tasks/", "tasks", b'{"batch_size": 1}')
    assert unknown.status == 404


async def test_a_reservation_whose_answer_is_lost_is_left_to_redelivery_and_said(
    fake: FakeAntenna,
) -> None:
    """Given Antenna reserves a task and the connection drops before its answer comes back,
    the fetch gets nothing and says the task is left to Antenna's redelivery; it is not asked
    again (one request per fetch), so no second task goes out behind it."""
    job = fake.add_job(SLUG, images(3))
    source = source_of(fake, size=1)
    (first,) = await source.fetch(1)
    first.handle.posted()  # its result posted: room for the next
    fake.misbehave("tasks", "drop", times=1)
    with structlog.testing.capture_logs() as logs:
        assert await source.fetch(1) == []
    (said,) = [e for e in logs if e["event"] == "antenna_reservation_unanswered"]
    assert said["job_id"] == job and said["action"] == "left to Antenna's redelivery"
    assert "WORKER_ANTENNA__TTR_S" in said["hint"]
    assert len([r for r in fake.requests if r[1].endswith("/tasks/")]) == 2  # one per fetch
    delivered = {t.image_id: t.delivered for t in fake.jobs[job].tasks.values()}
    assert delivered == {"i0": 1, "i1": 1, "i2": 0}


async def test_a_reservation_answered_after_the_deadline_is_left_to_redelivery_and_said(
    fake: FakeAntenna, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given Antenna reserves a task and its answer comes too slowly for the call's deadline,
    the fetch gets nothing and says the reservation went unanswered (Antenna may hold tasks
    for it until the TTR), not that Antenna was unreachable; it is not asked again."""
    import worker.antenna.source as source_module

    monkeypatch.setattr(source_module, "_UNAVAILABLE_BACKOFF_S", 0.0)
    job = fake.add_job(SLUG, images(2))
    client = AntennaClient(fake.url, SecretStr(TOKEN), 0.5)
    jobs = JobRotation(client, (SLUG,), 0.05, 100)
    reservations = Reservations(fake.ttr_s, 60.0, 1, batch_size=1)
    source = AntennaSource(
        client, jobs, reservations, reservation_size=1, wait_s=0.05, max_deliver=2
    )
    fake.misbehave("tasks", "slow", times=1, interval_s=0.1)  # served, then dripped
    with structlog.testing.capture_logs() as logs:
        assert await source.fetch(1) == []
    events = [e["event"] for e in logs]
    assert "antenna_reserve_unreachable" not in events
    (said,) = [e for e in logs if e["event"] == "antenna_reservation_unanswered"]
    assert said["job_id"] == job and said["action"] == "left to Antenna's redelivery"
    assert "not sent again" in said["error"]
    assert len([r for r in fake.requests if r[1].endswith("/tasks/")]) == 1  # not replayed
    delivered = {t.image_id: t.delivered for t in fake.jobs[job].tasks.values()}
    assert delivered == {"i0": 1, "i1": 0}


async def test_project_ids_scope_which_jobs_are_reserved_from(fake: FakeAntenna) -> None:
    fake.projects[2] = {}
    fake.register_direct(2, SERVED.config())
    ours = fake.add_job(SLUG, images(3, "a"), project=1)
    theirs = fake.add_job(SLUG, images(3, "b"), project=2)

    def scoped(projects: tuple[int, ...]) -> AntennaSource:
        client = client_of(fake)
        return AntennaSource(
            client,
            JobRotation(client, (SLUG,), 0.05, 100, projects),
            Reservations(fake.ttr_s, 60.0, 10, batch_size=10),
            reservation_size=10,
            wait_s=0.05,
            max_deliver=2,
        )

    got = await reserve_all(scoped((1,)), 6)  # asks for more than project 1 holds
    assert {d.handle.image_id for d in got} == {"a0", "a1", "a2"}  # (some twice: a TTR of 0.4 s)
    assert all(t.delivered == 0 for t in fake.jobs[theirs].tasks.values())  # untouched
    # A mistyped project is a refused listing, never every project's jobs: Antenna's
    # project_id alone would list them all (an id no project has filters nothing).
    typo = scoped((99,))
    assert await reserve_all(typo, 6) == []
    assert any(r[0] == "GET" and r[2] == 400 for r in fake.requests)
    everyone = await client_of(fake).get("jobs/", "jobs", {"project_id": 99, "limit": 10})
    assert {j["id"] for j in everyone.body["results"]} == {ours, theirs}
    assert all(t.delivered == 0 for t in fake.jobs[theirs].tasks.values())
    # Both projects named: both served, each listed on its own (project 1's tasks have had
    # their two deliveries by now).
    both = await reserve_all(scoped((1, 2)), 3)
    assert {d.handle.image_id for d in both} == {"b0", "b1", "b2"}


def test_the_delivery_count_is_read_from_the_reply_subject() -> None:
    assert delivered_of("$JS.ACK.job_1.job-1-consumer.2.3.4.1796116976120792999.0", 2) == 2
    assert delivered_of("$JS.ACK.dom.acc.job_1.c.1.3.4.179.0.x", 2) == 1
    assert delivered_of("not-a-subject", 2) == 2  # unknown: treated as the last


def test_nothing_more_is_reserved_while_the_oldest_reservation_is_late() -> None:
    from worker.antenna.reservations import Reservation

    reservations = Reservations(ttr_s=10.0, finish_within_s=5.0, first_size=4, batch_size=4)
    assert reservations.allowed() == 4

    def reserved(age_s: float) -> Reservation:
        at = time.monotonic() - age_s
        delivery = Reservation(1, SLUG, "i", "r", at, at + 10, reservations.settled)
        reservations.add(delivery)
        return delivery

    reserved(age_s=0.0)
    assert reservations.allowed() == 3  # within finish_within_s: the first size, less one
    reserved(age_s=6.0)  # reserved 6 s ago: past finish_within_s
    assert reservations.allowed() == 0 and reservations.oldest_seconds_left() < 5


def test_a_rate_too_slow_for_finish_within_still_reserves_a_batch_with_nothing_held() -> None:
    """Given a rate measured that finishes less than one task within ``finish_within_s``
    (a slow result post), a process holding nothing still reserves the batch's worth, and
    nothing behind what it holds; the rate follows faster work again, and waiting with
    nothing held does not lower it."""
    from worker.antenna.reservations import Reservation

    reservations = Reservations(ttr_s=0.2, finish_within_s=0.05, first_size=4, batch_size=4)

    def reserved() -> Reservation:
        at = time.monotonic()
        delivery = Reservation(1, SLUG, "i", "r", at, at + 0.2, reservations.settled)
        reservations.add(delivery)
        return delivery

    held = [reserved() for _ in range(4)]
    time.sleep(0.25)  # 4 tasks over at least 0.25 s held: at most 0.8 of one within 0.05 s
    for delivery in held:
        reservations.settled(delivery, posted=True)
    slow = reservations.rate_per_s()
    assert slow is not None and slow * reservations.finish_within_s < 1
    assert reservations.allowed() == 4  # nothing held: the batch's worth (it used to be 0)
    time.sleep(0.1)  # nothing held: no busy time, the rate stays as it was
    assert reservations.rate_per_s() == slow and reservations.allowed() == 4
    one = reserved()
    assert reservations.allowed() == 0  # nothing more behind what is held
    reservations.settled(one, posted=True)
    for _ in range(20):  # faster work: batches settled at once
        for delivery in [reserved() for _ in range(4)]:
            reservations.settled(delivery, posted=True)
    reserved()
    assert reservations.allowed() > 0  # the rate recovered: more may queue behind one


def test_a_reservation_size_over_the_batch_reserves_one_batch_with_nothing_held() -> None:
    """Given WORKER_ANTENNA__RESERVATION_SIZE 64, batches of 8 and a measured rate that
    finishes less than one task within ``finish_within_s``, a process holding nothing reserves
    one batch (8), not 64 that would run past their TTR and lose a delivery each; it says once
    that the floor overrides the rate."""
    from worker.antenna.reservations import Reservation

    reservations = Reservations(ttr_s=0.2, finish_within_s=0.05, first_size=64, batch_size=8)
    assert reservations.allowed() == 64  # no rate measured yet: the reservation size

    def reserved() -> Reservation:
        at = time.monotonic()
        delivery = Reservation(1, SLUG, "i", "r", at, at + 0.2, reservations.settled)
        reservations.add(delivery)
        return delivery

    held = [reserved() for _ in range(2)]
    time.sleep(0.1)  # 2 tasks over at least 0.1 s held: at most 1 within 0.05 s
    for delivery in held:
        reservations.settled(delivery, posted=True)
    slow = reservations.rate_per_s()
    assert slow is not None and slow * reservations.finish_within_s < 8
    with structlog.testing.capture_logs() as logs:
        assert reservations.allowed() == 8  # nothing held: one batch, not the 64
        assert reservations.allowed() == 8
    (said,) = [e for e in logs if e["event"] == "antenna_reservation_floor"]
    assert said["log_level"] == "info" and said["floor"] == 8
    assert said["rate_per_s"] == round(slow, 3) and said["finish_within_s"] == 0.05
