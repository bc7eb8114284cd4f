"""Which Antenna jobs a worker lists and rotates through (`worker.antenna.job_listing`), against
the fake Antenna."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog

from config.settings import load_settings
from tests.antenna_fake import FakeAntenna
from tests.unit.antenna.common import (
    SLUG,
    TOKEN,
    client_of,
    images,
    parts_of,
    reserve_all,
)
from worker.antenna.job_listing import JobRotation
from worker.antenna.waiting import antenna_waiting_read


async def test_every_active_job_is_listed_not_antennas_one_random_job(fake: FakeAntenna) -> None:
    # Antenna lists one random job per call unless it is given a limit (the fake does too)
    ids = [fake.add_job(SLUG, images(1, f"j{n}-")) for n in range(4)]
    rotation = JobRotation(client_of(fake), (SLUG,), 10.0, 100)
    assert sorted(j.id for j in await rotation.refresh()) == sorted(ids)


async def test_only_started_and_retry_jobs_are_rotated_in_turn(fake: FakeAntenna) -> None:
    ids = {
        s: fake.add_job(SLUG, images(1, s))
        for s in ("STARTED", "CREATED", "PENDING", "CANCELING", "RETRY", "SUCCESS")
    }
    for status, job in ids.items():
        fake.jobs[job].status = status
    rotation = JobRotation(client_of(fake), (SLUG,), 10.0, 100)
    active = await rotation.refresh()
    assert [j.id for j in active] == [ids["STARTED"], ids["RETRY"]]
    rotation.reserved_from(active[0])
    assert [j.id for j in rotation.next_jobs()] == [ids["RETRY"], ids["STARTED"]]


async def test_jobs_of_every_served_pipeline_are_rotated_and_no_other_pipelines(
    fake: FakeAntenna,
) -> None:
    moths = fake.add_job(SLUG, images(1, "m"))
    orders = fake.add_job("orders", images(1, "o"))
    other = fake.add_job("beetles", images(1, "b"))
    rotation = JobRotation(client_of(fake), (SLUG, "orders"), 10.0, 100)
    active = await rotation.refresh()
    assert [(j.id, j.pipeline) for j in active] == [(moths, SLUG), (orders, "orders")]

    # An Antenna that ignored the filter would list another pipeline's job: it is not taken.
    listed = fake._list
    fake._list = lambda query, user=None: listed({**query, "pipeline__slug__in": ""}, user)  # type: ignore[method-assign]
    rotation = JobRotation(client_of(fake), (SLUG, "orders"), 10.0, 100)
    assert other not in [j.id for j in await rotation.refresh()]


async def test_jobs_listed_without_their_pipeline_slug_are_still_served(
    fake: FakeAntenna,
) -> None:
    """Antenna's ids-only jobs list gave ``id`` alone before it gave ``pipeline_slug``: the
    job's own page names its pipeline; with neither, a worker of one pipeline takes the job
    Antenna listed for its slug, one of several leaves it."""
    moths = fake.add_job(SLUG, images(1, "m"))
    orders = fake.add_job("orders", images(1, "o"))
    listed, answer = fake._list, fake.handle

    def ids_alone(query: dict[str, str], user: Any = None) -> tuple[int, Any]:
        status, body = listed(query, user)
        return status, {**body, "results": [{"id": j["id"]} for j in body["results"]]}

    fake._list = ids_alone  # type: ignore[method-assign]
    rotation = JobRotation(client_of(fake), (SLUG, "orders"), 10.0, 100)
    assert [(j.id, j.pipeline) for j in await rotation.refresh()] == [
        (moths, SLUG),
        (orders, "orders"),
    ]

    def no_slug_anywhere(method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        status, body = answer(method, path, *args, **kwargs)
        if isinstance(body, dict) and "status" in body:  # a job's page
            body = {k: v for k, v in body.items() if k != "pipeline_slug"}
        return status, body

    fake.handle = no_slug_anywhere  # type: ignore[method-assign]
    fake.jobs[orders].status = "SUCCESS"
    one = JobRotation(client_of(fake), (SLUG,), 10.0, 100)
    assert [(j.id, j.pipeline) for j in await one.refresh()] == [(moths, SLUG)]
    fake.jobs[orders].status = "STARTED"
    several = JobRotation(client_of(fake), (SLUG, "orders"), 10.0, 100)
    assert await several.refresh() == []  # whose job is it? not reserved from


async def test_a_refused_project_is_named_and_the_other_projects_are_served(
    fake: FakeAntenna,
) -> None:
    # A mistyped, deleted or no longer permitted project id (Antenna answers 400 for it)
    # blocks none of the others: their jobs are served, and the refusal names the project
    # wherever the source's problems are said (/readyz, an unserved --until-idle).
    fake.add_job(SLUG, images(3, "a"), project=1)
    antenna = {"base_url": fake.url, "token": TOKEN, "project_ids": "1,99", "ttr_s": 0.5}
    configured = load_settings(for_worker=False, antenna={**antenna, "poll_interval_s": 0.05})
    parts = parts_of(configured)
    try:
        got = await reserve_all(parts.source, 3)
        assert {d.handle.image_id for d in got} == {"a0", "a1", "a2"}
        for said in (parts.problem(), parts.unserved()):
            assert said is not None and "project 99's jobs: HTTP 400" in said, said
            assert "WORKER_ANTENNA__PROJECT_IDS" in said and "project 1'" not in said
        waiting = antenna_waiting_read(parts.client, (SLUG,), 100, (1, 99))
        assert await waiting() == {SLUG: 3}  # project 1's, held ones included
        fake.projects[99] = {}  # the project exists now: listed, and the refusal is gone
        await parts.jobs.refresh()
        assert parts.jobs.refused_projects == {} and parts.problem() is None
    finally:
        parts.client.close()


def ids_only_listing(fake: FakeAntenna) -> None:
    """The fake's jobs list gives each job's ``id`` alone (an Antenna whose ids-only
    serializer left ``pipeline_slug`` out): a worker of several pipelines reads each job's page."""
    listed = fake._list

    def ids_alone(query: dict[str, str], user: Any = None) -> tuple[int, Any]:
        status, body = listed(query, user)
        return status, {**body, "results": [{"id": j["id"]} for j in body["results"]]}

    fake._list = ids_alone  # type: ignore[method-assign]


BAD_GATEWAY = {"status": 502, "body": b'{"detail": "Bad Gateway"}'}


async def test_a_job_whose_page_failed_once_is_asked_again_and_served(fake: FakeAntenna) -> None:
    """One 502 on a job's own page once made it 'not ours' for good: a burst run then stopped
    idle with the whole job unserved."""
    moths = fake.add_job(SLUG, images(2, "m"))
    ids_only_listing(fake)
    fake.misbehave("job", "json", times=1, **BAD_GATEWAY)
    rotation = JobRotation(client_of(fake), (SLUG, "orders"), 0.05, 100)
    with structlog.testing.capture_logs() as logs:
        assert await rotation.refresh() == []
    (said,) = [e for e in logs if e["event"] == "antenna_job_unread"]
    assert said["job_id"] == moths and "HTTP 502" in said["reason"], said
    assert "antenna_job_not_ours" not in [e["event"] for e in logs]
    await asyncio.sleep(0.06)  # its backoff: one poll interval
    assert [(j.id, j.pipeline) for j in await rotation.refresh()] == [(moths, SLUG)]
    assert rotation.unread() == {}


async def test_a_burst_run_would_end_idle_names_the_job_whose_page_was_never_read(
    fake: FakeAntenna,
) -> None:
    moths = fake.add_job(SLUG, images(2, "m"))
    ids_only_listing(fake)
    fake.misbehave("job", "json", **BAD_GATEWAY)
    antenna = {
        "base_url": fake.url,
        "token": TOKEN,
        "project_ids": "1",
        "poll_interval_s": 0.05,
        "fetch_wait_s": 0.05,
        "unreachable_wait_s": 0.5,
    }
    parts = parts_of(load_settings(for_worker=False, antenna=antenna), names=(SLUG, "orders"))
    try:
        assert await parts.source.fetch(4) == []
        assert not await parts.source.idle()  # asked again before the bound
        deadline = time.monotonic() + 30
        while not await parts.source.idle():
            assert await parts.source.fetch(4) == []
            assert time.monotonic() < deadline, "never idle"
        why = parts.unserved()
        assert why is not None and f"job(s) {moths} " in why and "HTTP 502" in why, why
        assert "WORKER_ANTENNA__UNREACHABLE_WAIT_S" in why
        asked = [r for r in fake.requests if r[1].endswith(f"/jobs/{moths}/")]
        assert len(asked) >= 2  # asked again, with backoff
    finally:
        parts.client.close()


async def test_antenna_answering_errors_to_every_listing_is_not_ready_until_one_answers(
    fake: FakeAntenna,
) -> None:
    # Antenna behind a working connection answering 500 to every job listing (its database
    # gone, say) finds no job: /readyz says so past the disconnect timeout, as it says a
    # timeout or a 503, and clears at the first listing that answers. /livez is not asked:
    # a restart of the worker mends nothing of Antenna's.
    antenna = {"base_url": fake.url, "token": TOKEN, "project_ids": "1"}
    configured = load_settings(
        for_worker=False, antenna=antenna, health={"disconnected_timeout_s": 0.2}
    )
    parts = parts_of(configured)
    fake.misbehave("jobs", "json", status=500, body=b'{"detail": "server error"}')
    try:
        await parts.jobs.refresh()
        assert parts.problem() is None, "one failed listing is not yet a problem"
        await asyncio.sleep(0.3)
        await parts.jobs.refresh()
        said = parts.problem()
        assert said is not None and "Antenna" in said and "500" in said, said
        fake.behave("jobs")
        await parts.jobs.refresh()
        assert parts.problem() is None
    finally:
        parts.client.close()


async def test_jobs_listed_twice_for_a_token_not_a_superusers_are_rotated_once(
    fake: FakeAntenna,
) -> None:
    first, second = fake.add_job(SLUG, images(1, "a")), fake.add_job(SLUG, images(1, "b"))
    fake.tokens["member"] = {1}
    listed = await client_of(fake, "member").get(
        "jobs/", "jobs", {"pipeline__slug__in": SLUG, "ids_only": 1, "limit": 10}
    )
    assert sorted(j["id"] for j in listed.body["results"]) == [first, first, second, second]
    rotation = JobRotation(client_of(fake, "member"), (SLUG,), 10.0, 100)
    assert [j.id for j in await rotation.refresh()] == [first, second]
    assert [j.id for j in rotation.next_jobs()] == [first, second]


async def test_every_page_of_active_jobs_is_listed_and_no_job_page_is_asked(
    fake: FakeAntenna,
) -> None:
    ids = [fake.add_job(SLUG, images(1, f"j{n}-")) for n in range(25)]
    fake.jobs[ids[3]].status = "PENDING"
    fake.jobs[ids[7]].status = "RETRY"
    rotation = JobRotation(client_of(fake), (SLUG,), 10.0, 10)
    active = await rotation.refresh()
    assert [j.id for j in active] == [i for i in ids if i != ids[3]]
    assert not [p for _m, p, _s in fake.requests if p.rstrip("/").split("/")[-1].isdigit()]
    lists = [p for _m, p, _s in fake.requests if p == "/api/v2/jobs/"]
    assert len(lists) == 3 + 1  # STARTED: 24 jobs in pages of 10; RETRY: one page
