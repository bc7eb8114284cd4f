"""A value sampled in the background while a benchmark runs, stopped by an event, never by
cancelling it.

Why not ``task.cancel()``: on Python 3.11, ``asyncio.wait_for`` returns the result instead of
raising ``CancelledError`` when the cancel comes in the loop turn the awaited future is done
(CPython gh-86296, bpo-42130; fixed in 3.12, whose ``wait_for`` is built on
``asyncio.timeout``). nats-py waits for every request's reply so (``Client._request_new_style``:
``await asyncio.wait_for(future, timeout)``), so a sampler cancelled while its
``stream_info`` reply arrives carries on with its loop, and whoever awaits it waits forever:
``bench.many_jobs --smoke`` stalled so beside busy loops, after every result was stored. Here
the loop ends at its next turn once told, whatever became of a cancel.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


@contextlib.asynccontextmanager
async def sampled(probe: Callable[[], Awaitable[T]], every_s: float) -> AsyncIterator[list[T]]:
    """``probe()``'s values, one every ``every_s``, while inside; on leaving, the sampler is
    told to stop and awaited (one probe's own time at most: a probe must be bounded)."""
    seen: list[T] = []
    stop = asyncio.Event()

    async def sample() -> None:
        while not stop.is_set():
            seen.append(await probe())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)

    sampler = asyncio.create_task(sample())
    try:
        yield seen
    finally:
        stop.set()
        await sampler
