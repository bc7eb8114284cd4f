"""A write to a stream, retried in-process while the stream does not confirm, for
``WORKER_NATS__STORE_RETRY_S``: a result already computed is no reason to spend one of its
task's deliveries on an outage of the results stream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from config.errors import ResultsUnavailable

_RETRY_FIRST_S = 0.2
_RETRY_MAX_S = 5.0


async def patiently(write: Callable[[], Awaitable[None]], retry_for_s: float) -> None:
    """Run ``write`` until it does not raise ResultsUnavailable, for ``retry_for_s``; a
    closed connection is not waited out."""
    deadline = time.monotonic() + retry_for_s
    delay_s = _RETRY_FIRST_S
    while True:
        try:
            await write()
            return
        except ResultsUnavailable as failure:
            if failure.connection_closed:
                raise
            if time.monotonic() + delay_s > deadline:
                raise
        await asyncio.sleep(delay_s)
        delay_s = min(delay_s * 2, _RETRY_MAX_S)
