"""Bounded fetches from the durable pull consumer: the NATS ``TaskSource``."""

from __future__ import annotations

import asyncio
from typing import Any

import nats
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from config.settings import NatsSettings
from worker.nats.subjects import advisory_consumer

log = structlog.get_logger(__name__)


class TaskFeed:
    """Bounded fetches from the durable pull consumer (the orchestrator's TaskSource)."""

    def __init__(self, nc: NATS, settings: NatsSettings) -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self._settings = settings
        self._sub: Any = None

    async def open(self) -> None:
        self._sub = await self._js.pull_subscribe_bind(
            durable=self._settings.consumer, stream=self._settings.tasks_stream
        )

    async def max_deliver(self) -> int:
        """The server's setting, which is what counts (not ours)."""
        info = await self._js.consumer_info(self._settings.tasks_stream, self._settings.consumer)
        value = info.config.max_deliver
        return int(value) if value and value > 0 else 1_000_000

    async def idle(self) -> bool:
        """Nothing pending and nothing awaiting an ack, anywhere: on the tasks consumer, and
        on the max-deliveries consumer (whose handler may still owe a task its result)."""
        consumers = [
            (self._settings.tasks_stream, self._settings.consumer),
            (self._settings.advisory_stream, advisory_consumer(self._settings)),
        ]
        try:
            for stream, consumer in consumers:
                info = await self._js.consumer_info(stream, consumer)
                if info.num_pending or info.num_ack_pending:
                    return False
        except (nats.errors.Error, TimeoutError):
            return False
        return True

    async def fetch(self, batch: int) -> list[Msg]:
        """Up to ``batch`` messages; [] after ``fetch_timeout_s`` or while disconnected."""
        try:
            msgs: list[Msg] = await self._sub.fetch(batch, timeout=self._settings.fetch_timeout_s)
            return msgs
        except (TimeoutError, nats.errors.TimeoutError):
            return []
        except (
            nats.errors.ConnectionClosedError,
            nats.errors.ConnectionReconnectingError,
            nats.errors.NoRespondersError,
            nats.js.errors.ServiceUnavailableError,
        ) as error:
            log.warning("fetch_failed_will_retry", error=type(error).__name__)
            await asyncio.sleep(self._settings.fetch_timeout_s)
            return []

    async def close(self) -> list[Msg]:
        """Stop fetching for good; return messages delivered after the last fetch gave up.

        The subscription goes first, so the server drops our open pull requests: tasks given
        back afterwards are redelivered to other workers, not straight back to us.
        """
        if self._sub is None:
            return []
        pending = late_deliveries(self._sub)
        try:
            await self._sub.unsubscribe()
            await self._nc.flush(timeout=5)
        except (nats.errors.Error, TimeoutError):
            pass
        self._sub = None
        found: list[Msg] = []
        while pending is not None and not pending.empty():
            msg = pending.get_nowait()
            if not JetStreamContext.is_status_msg(msg):
                found.append(msg)
        return found


def late_deliveries(sub: Any) -> asyncio.Queue[Msg] | None:
    """The queue where nats-py keeps messages delivered to a pull subscription after its
    last fetch returned (``PullSubscription._sub._pending_queue``, nats-py 2.x; the one
    private attribute of nats-py we read, tested in ``tests/unit/test_transport.py``).

    If it has moved, None: those messages are then not given back at once but wait out
    their ack wait, which costs time, never a task.
    """
    queue = getattr(getattr(sub, "_sub", None), "_pending_queue", None)
    if isinstance(queue, asyncio.Queue):
        return queue
    log.warning(
        "nats_internals_moved",
        hint="late deliveries are left to their ack wait; check the nats-py version",
    )
    return None
