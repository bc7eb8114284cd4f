"""The fetch loop: while there is room under the cap, fetch from the source, admit what it
delivered (``Admission``), and hand the held tasks to the batches.

Before each fetch, the held tasks of jobs no longer active are dropped (``InactiveJobDrops``),
also while there is no room. A fetch that raised is tried again after a backoff that doubles
(``_FIRST_FETCH_BACKOFF_S`` to ``_MAX_FETCH_BACKOFF_S``); in burst mode, after
``_BURST_FAILED_FETCHES`` in a row the run ends NOT_SERVED (a source that raises on every
fetch is never idle, so the run would never end).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import structlog

from worker.core.admission import Admission
from worker.core.availability import Availability
from worker.core.batches import Batches
from worker.core.claims import Claims
from worker.core.dropping import InactiveJobDrops
from worker.core.endings import Endings
from worker.core.link import SourceLink

log = structlog.get_logger(__name__)
_FIRST_FETCH_BACKOFF_S = 1.0  # a fetch that raised: tried again after this, doubling
_MAX_FETCH_BACKOFF_S = 30.0
_BURST_FAILED_FETCHES = 5  # in a row, with --until-idle: the run ends NOT_SERVED (exit 6)


class Fetching:
    def __init__(
        self,
        link: SourceLink[Any],
        admission: Admission,
        claims: Claims,
        batches: Batches,
        drops: InactiveJobDrops,
        availability: Availability,
        endings: Endings,
        batch_size: int,
        *,
        until_idle: bool,
    ) -> None:
        self._link = link
        self._admission = admission
        self._claims = claims
        self._batches = batches
        self._drops = drops
        self._availability = availability
        self._endings = endings
        self._batch_size = batch_size
        self._until_idle = until_idle

    async def run(self) -> None:
        """Until the run stops (``Endings.stop``)."""
        stop = self._endings.stop
        timeout_s = self._link.fetch_wait_s
        backoff_s = _FIRST_FETCH_BACKOFF_S
        failed = 0  # fetches in a row that raised
        while not stop.is_set():
            await self._drops.drop()  # also while no room: a full cap is the common case
            room = self._claims.room()
            if room <= 0:
                await self._claims.wait_for_room(timeout_s)
                continue
            try:
                deliveries = await self._link.source.fetch(
                    min(self._batch_size, room),
                    self._batches.runnable,
                    self._availability.available,
                )
            except Exception as error:  # the source's boundary: never the process
                failed += 1
                log.error(
                    "fetch_failed",
                    error=f"{type(error).__name__}: {error}",
                    failed_in_a_row=failed,
                    retry_in_s=backoff_s,
                    exc_info=error,
                )
                if self._until_idle and failed >= _BURST_FAILED_FETCHES:
                    why = f"the task source failed {failed} fetches in a row: "
                    self._endings.not_served(f"{why}{type(error).__name__}: {error}")
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), backoff_s)
                backoff_s = min(backoff_s * 2, _MAX_FETCH_BACKOFF_S)
                continue
            backoff_s, failed = _FIRST_FETCH_BACKOFF_S, 0
            # Concurrently: each asks the results stream whether its task is done already.
            admitted = await asyncio.gather(*map(self._admission.admit, deliveries))
            self._batches.add([claim for claim in admitted if claim])
