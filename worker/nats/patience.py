"""A write to a stream, retried in-process while the stream does not confirm, for
``WORKER_NATS__STORE_RETRY_S``: a result already computed is no reason to spend one of its
task's deliveries on an outage of the results stream. While the client is reconnecting (a
stale connection dropped, another server being tried) the next try waits for the new
connection and is made on it at once, within the same bound."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from config.errors import ResultsUnavailable

_RETRY_FIRST_S = 0.2
_RETRY_MAX_S = 5.0
UntilConnected = Callable[[float], Awaitable[None]]


async def at_once(_timeout_s: float) -> None:
    """An ``UntilConnected`` for a write with no connection to wait for."""


async def patiently(
    write: Callable[[], Awaitable[None]],
    retry_for_s: float,
    until_connected: UntilConnected = at_once,
) -> None:
    """Run ``write`` until it does not raise ResultsUnavailable; the last try starts at most
    ``retry_for_s`` after the first. A closed connection is not waited out; one being
    replaced is (``until_connected``, bounded by what is left)."""
    deadline = time.monotonic() + retry_for_s
    delay_s = _RETRY_FIRST_S
    while True:
        try:
            await write()
            return
        except ResultsUnavailable as failure:
            left_s = deadline - time.monotonic()
            if failure.connection_closed or left_s <= 0:
                raise
        await asyncio.sleep(min(delay_s, left_s))  # a last try at the deadline itself
        await until_connected(deadline - time.monotonic())
        delay_s = min(delay_s * 2, _RETRY_MAX_S)
