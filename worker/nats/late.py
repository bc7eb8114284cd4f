"""What a pull subscription received after its last fetch gave up: taken when it is closed, so
those tasks are given back (or admitted) at once rather than after their ack wait. Used by the
feed's durable subscription (``worker.nats.feed``) and by each job's
(``worker.nats.job_consumers``)."""

from __future__ import annotations

import asyncio
from typing import Any

import nats
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

log = structlog.get_logger(__name__)


def late_deliveries(sub: Any) -> asyncio.Queue[Msg] | None:
    """The queue where nats-py keeps messages delivered to a pull subscription after its
    last fetch returned (``PullSubscription._sub._pending_queue``, nats-py 2.x; tested in
    ``tests/unit/nats/test_late.py``; the only other private part of nats-py we read is its
    socket, in ``worker.nats.connection.abort_socket``).

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


async def unsubscribe(sub: Any, flush: NATS | None = None) -> list[Msg]:
    """Unsubscribe ``sub`` (then flush ``flush``, when given, so the server has dropped our
    open pull requests before anything is given back); returns the messages it had received
    after its last fetch returned, status messages left out."""
    pending = late_deliveries(sub)
    try:
        await sub.unsubscribe()
        if flush is not None:
            await flush.flush(timeout=5)
    except (nats.errors.Error, TimeoutError):
        pass
    found: list[Msg] = []
    while pending is not None and not pending.empty():
        msg = pending.get_nowait()
        if not JetStreamContext.is_status_msg(msg):
            found.append(msg)
    return found
