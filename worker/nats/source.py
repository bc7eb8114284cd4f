"""The NATS ``TaskSource``: the feed's messages (``worker.nats.feed.TaskFeed``) read once into
the core's ``Delivered`` tasks, each carrying the consumers' ``max_deliver`` (the server's
setting, which is what counts; every consumer the worker reads from carries the same,
``worker.nats.lifecycle``)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import structlog

from worker.core.ports import Runnable
from worker.nats.delivery import NatsDelivered, delivered
from worker.nats.feed import TaskFeed

log = structlog.get_logger(__name__)


class NatsSource:
    def __init__(self, feed: TaskFeed, max_deliver: int, default_pipeline: str) -> None:
        self.feed = feed
        self.max_deliver = max_deliver
        self.default_pipeline = default_pipeline  # a task on ``tasks`` alone names none
        self.delivered = 0  # messages the feed has handed over since the start

    async def fetch(
        self, batch: int, runnable: Runnable | None = None, available: Runnable | None = None
    ) -> list[NatsDelivered]:
        return await self._adapted(await self.feed.fetch(batch, runnable, available))

    async def close(self) -> list[NatsDelivered]:
        return await self._adapted(await self.feed.close())

    async def idle(self) -> bool:
        return await self.feed.idle()

    async def _adapted(self, msgs: Sequence[Any]) -> list[NatsDelivered]:
        """Each message read once; one whose JetStream metadata cannot be read (no JetStream
        reply subject) is logged and given back alone, never the whole fetch."""
        adapted = []
        self.delivered += len(msgs)  # read or not, they came: the source answers
        for msg in msgs:
            try:
                adapted.append(delivered(msg, self.max_deliver, self.default_pipeline))
            except Exception as error:  # noqa: BLE001 - one message, not the fetch
                log.warning("task_message_unreadable", error=f"{type(error).__name__}: {error}")
                with contextlib.suppress(Exception):
                    await msg.nak()
        return adapted
