"""An idle process lists the job consumers less and less often, and a new job's first task is
still served at once, by its hint, with no listing (worker/nats/listing_cadence.py).

The listings are counted as the nats-server routes them: every consumer listing is a request
on ``$JS.API.CONSUMER.LIST.<stream>``, and a plain subscription there gets each one. The
counts are per fetch, not per second, so a slow machine changes nothing: before, every idle
fetch past the discovery interval listed; now the interval doubles after each idle listing."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.helpers import upload_images
from tests.integration.test_job_consumers import fill_consumers, limited_nats
from worker.commands.job_client import make_tasks, publish_tasks
from worker.nats.connection import connect
from worker.nats.feed import TaskFeed
from worker.nats.provision import provision

pytestmark = pytest.mark.integration
IDLE_FETCHES = 60  # each waits 50 ms for a hint, then pulls for 50 ms: past the 50 ms interval
MOST_FETCHES = 400  # bounds every loop below
REFUSED_FETCHES = 10  # about a second: within the backed-off interval
QUICK = {"job_discovery_s": 0.05, "job_discovery_idle_s": 60.0, "fetch_timeout_s": 0.05}


async def counted_listings(nc: Any, stream: str) -> tuple[list[str], Any]:
    """Every consumer listing of ``stream`` as the server routes it, and the subscription."""
    listings: list[str] = []

    async def listed(msg: object) -> None:
        listings.append("listing")

    return listings, await nc.subscribe(f"$JS.API.CONSUMER.LIST.{stream}", cb=listed)


async def until_a_listing(feed: TaskFeed, nc: Any, listings: list[str]) -> None:
    """Fetch until the process lists once more (``MOST_FETCHES`` at most)."""
    before = len(listings)
    for _ in range(MOST_FETCHES):
        if len(listings) > before:
            break
        await feed.fetch(8)
        await nc.flush()
    assert len(listings) > before, "no listing in the bound"


async def test_an_idle_process_lists_less_often_and_still_serves_a_new_job_at_once(
    nats_server, s3_server, bucket, settings_for
):
    settings = settings_for(nats_server.url, nats=QUICK)
    n, pipeline = settings.nats, settings.model.pipeline
    uris = upload_images(s3_server.client(), bucket, 1)
    nc = await connect(n, give_up_after_s=30)
    js = nc.jetstream()
    await provision(js, n, pipeline)
    listings, counter = await counted_listings(nc, n.tasks_stream)
    feed = TaskFeed(nc, n, [pipeline])
    try:
        await feed.open()
        await nc.flush()
        # Given an idle process fetching with nothing to do
        at_start = len(listings)
        for _ in range(IDLE_FETCHES):
            assert await feed.fetch(8) == []
        await nc.flush()
        idle_listings = len(listings) - at_start
        # When a job is published just after one of its listings
        await until_a_listing(feed, nc, listings)
        (task,) = make_tasks("job-after-idle", uris)
        await publish_tasks(js, n, pipeline, [task])
        published_at = len(listings)
        got = []
        for _ in range(MOST_FETCHES):
            got = await feed.fetch(8)
            if got:
                break
        await nc.flush()
        served_with = len(listings) - published_at
        for msg in got:
            await msg.ack()
    finally:
        await feed.close()
        await counter.unsubscribe()
        await nc.close()

    # Then it listed far less often than once per fetch (each fetch here outlasts the
    # 50 ms discovery interval: every one of them listed before)
    assert idle_listings <= IDLE_FETCHES // 4, f"{idle_listings} listings in {IDLE_FETCHES}"
    # And the new job's task was fetched, heard of and served with no listing
    assert [json.loads(m.data)["id"] for m in got] == [task.id]
    assert served_with == 0


async def test_a_job_refused_room_keeps_the_listing_at_its_base_cadence_on_an_idle_process(
    tmp_path, s3_server, bucket, settings_for
):
    """A refused consumer is retried at every listing; an idle process whose listing had backed
    off must list at the base cadence again once a job waits for room (the hinted job's
    consumer is refused between two listings, so no listing had seen it: it once waited out
    the backed-off interval, one refusal counted in six seconds)."""
    uris = upload_images(s3_server.client(), bucket, 1)
    with limited_nats(tmp_path) as url:
        settings = settings_for(url, nats=QUICK)
        n, pipeline = settings.nats, settings.model.pipeline
        nc = await connect(n, give_up_after_s=30)
        js = nc.jetstream()
        await provision(js, n, pipeline)
        listings, counter = await counted_listings(nc, n.tasks_stream)
        feed = TaskFeed(nc, n, [pipeline])
        other = None
        try:
            await feed.open()
            # Given an idle process whose listing has backed off
            for _ in range(IDLE_FETCHES):
                assert await feed.fetch(8) == []
            # And another client's consumers filling the server's room
            other, _ = await fill_consumers(url, n.tasks_stream)
            # When a job comes just after one of its listings, its consumer refused
            await until_a_listing(feed, nc, listings)
            await publish_tasks(js, n, pipeline, make_tasks("job-no-room", uris))
            for _ in range(MOST_FETCHES):
                stats = feed.job_stats()
                if stats is not None and stats.refused:
                    break
                assert await feed.fetch(8) == []
            await nc.flush()
            refused_at = len(listings)
            for _ in range(REFUSED_FETCHES):
                assert await feed.fetch(8) == []
            await nc.flush()
            listed_while_refused = len(listings) - refused_at
            stats = feed.job_stats()
        finally:
            if other is not None:
                await other.close()
            await feed.close()
            await counter.unsubscribe()
            await nc.close()

    # Then it lists at (nearly) every fetch again, each fetch outlasting the base interval,
    # and counts the server's refusal at each of them
    assert stats is not None
    assert listed_while_refused >= REFUSED_FETCHES // 2, listed_while_refused
    assert stats.refused > 2, stats.refused
