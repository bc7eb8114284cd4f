"""The NATS ``TaskSource``: the feed's messages (``worker.nats.feed.TaskFeed``) as the core's
deliveries, each carrying the consumers' ``max_deliver`` (the server's setting, which is what
counts; every consumer the worker reads from carries the same, ``worker.nats.lifecycle``)."""

from __future__ import annotations

from collections.abc import Sequence

from worker.nats.delivery import NatsDelivery
from worker.nats.feed import TaskFeed
from worker.ports import Runnable


class NatsSource:
    def __init__(self, feed: TaskFeed, max_deliver: int) -> None:
        self.feed = feed
        self.max_deliver = max_deliver

    async def fetch(self, batch: int, runnable: Runnable | None = None) -> list[NatsDelivery]:
        return self._adapted(await self.feed.fetch(batch, runnable))

    async def close(self) -> list[NatsDelivery]:
        return self._adapted(await self.feed.close())

    async def idle(self) -> bool:
        return await self.feed.idle()

    def _adapted(self, msgs: Sequence[object]) -> list[NatsDelivery]:
        return [NatsDelivery(msg, self.max_deliver) for msg in msgs]  # type: ignore[arg-type]
