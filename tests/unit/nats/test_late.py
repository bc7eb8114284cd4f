"""The one nats-py internal we read: where late deliveries wait. Found, or a clear fallback."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from worker.nats.connection import connect
from worker.nats.feed import TaskFeed
from worker.nats.late import late_deliveries
from worker.nats.provision import provision


def test_if_nats_py_moves_its_pending_queue_the_feed_degrades_instead_of_raising():
    assert late_deliveries(SimpleNamespace()) is None
    assert late_deliveries(SimpleNamespace(_sub=SimpleNamespace())) is None


async def test_a_real_pull_subscription_has_the_queue_we_read(nats_server, settings_for):
    settings = settings_for(nats_server.url)
    nc = await connect(settings.nats, give_up_after_s=30)
    try:
        await provision(nc.jetstream(), settings.nats, settings.model.pipeline)
        feed = TaskFeed(nc, settings.nats)
        await feed.open()
        assert isinstance(late_deliveries(feed._sub), asyncio.Queue)
        assert await feed.close() == []
    finally:
        await nc.close()
