"""The drain: once the run stops, the fetch in flight finished, the batch in hand run, and
everything else given back, each step bounded, so the process always ends.

The drain timeout counts from the stop (``begin``). The fetch in flight may finish, as long
as the source's give-back needs (``let_fetch_finish``); then the source is closed (what it
delivered after the last fetch is given back), the tasks waiting for a batch are given back
(with ``finish_held_on_stop``: their batches run first, while the time left holds one more),
and the batch in hand is waited for until the timeout; past it, its run is cancelled, which
gives back at once what it has not acked. Each give-back is bounded
(``claims.GIVE_BACK_WAIT_S``); what could not be given back is named and left for its ack
wait. Each bounded wait gets a fresh watchdog window (``Liveness.still_working``): the
watchdog outlasts the longest of them (a settings rule, ``config.cross_checks``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import structlog

from worker.core.batches import CANCELLED_SETTLES_WAIT_S, Batches
from worker.core.claims import GIVE_BACK_WAIT_S, LEFT_FOR_ACK_WAIT, Claims
from worker.core.link import SourceLink
from worker.core.ports import Delivered
from worker.core.settling import BatchSettling, Settling
from worker.core.verdicts import Decision, Verdict
from worker.health.liveness import Liveness

log = structlog.get_logger(__name__)
_DRAIN_TICK_S = 0.05  # how often a drain that finishes the held tasks looks again
# A cancelled processor ends once its settles have given back (``CANCELLED_SETTLES_WAIT_S`` at
# most); a second more, then the drain goes on without it.
_PROCESSOR_END_S = CANCELLED_SETTLES_WAIT_S + 1.0


class Drain:
    def __init__(
        self,
        link: SourceLink[Any],
        batches: Batches,
        claims: Claims,
        settling: Settling,
        settled: BatchSettling,
        liveness: Liveness,
        timeout_s: float,
    ) -> None:
        self._link = link
        self._batches = batches
        self._claims = claims
        self._settling = settling
        self._settled = settled  # the last batches' times: whether one more fits
        self._liveness = liveness
        self.timeout_s = timeout_s
        self._by = float("inf")  # time.monotonic() by which a stop must be drained

    def begin(self) -> None:
        """The run stopped: the drain timeout counts from now. The watchdog's window starts
        over: the drain timeout is shorter than it (a settings rule), and a drain that makes
        progress feeds it."""
        self._by = time.monotonic() + self.timeout_s
        self._liveness.still_working()

    def left_s(self) -> float:
        """What is left of the drain timeout since the stop (the fetch in flight, then the
        batch in hand, share it)."""
        return max(0.0, self._by - time.monotonic())

    async def let_fetch_finish(self, fetcher: asyncio.Task[None]) -> None:
        """Cancelling a fetch in flight would strand the messages the server already
        delivered to us until their ack wait runs out. A source whose give-back costs
        (``finish_held_on_stop``: an Antenna reservation is answered whenever its server
        answers, and what it reserved is lost to the TTR) is waited for as long as the drain
        allows, so what it delivers is run or given back with its line; what is still in
        flight then is cancelled, and the source says what it leaves."""
        wait_s = self.left_s()
        if not self._link.finish_held_on_stop:
            wait_s = min(self._link.fetch_wait_s + 5, wait_s)
        try:
            await asyncio.wait_for(asyncio.shield(fetcher), wait_s)
        except Exception:  # noqa: BLE001 - a timeout, or a failure reported by the run
            fetcher.cancel()
            await asyncio.gather(fetcher, return_exceptions=True)

    async def run(self, processor: asyncio.Task[None]) -> None:
        """Finish the batch in hand within the drain timeout; give back everything else now
        (with ``finish_held_on_stop``: run the held tasks' batches first, while the drain time
        allows one more, and give back only what is left)."""
        leftovers = await self._link.source.close()
        self._liveness.still_working()
        if self._link.finish_held_on_stop:
            await self._finish_held(processor)
        # Each bounded wait from here may begin past the drain's timeout: each gets a fresh
        # watchdog window (the start-up rule: the watchdog outlasts the longest of them).
        self._liveness.still_working()
        await self._claims.give_back_within(self._batches.stop(), "shutting down")
        self._liveness.still_working()
        await self._give_back_leftovers(leftovers)
        self._liveness.still_working()
        if not (await asyncio.wait({processor}, timeout=max(self.left_s(), 0.1)))[0]:
            log.error(
                "drain_timeout",
                held=len(self._claims),
                action="giving back every held task whose result is not stored and acked",
            )
            # The batches' run passes the cancel on to the settles in flight; each gives back
            # at once what it has not acked: a nak, a local note, but one that can hang on a
            # hung connection, so each give-back and the wait for the run are bounded.
            self._liveness.still_working()  # the drain's timeout is reached
            processor.cancel()
            if not (await asyncio.wait({processor}, timeout=_PROCESSOR_END_S))[0]:
                log.error(
                    "drain_processor_stuck",
                    waited_s=_PROCESSOR_END_S,
                    held=len(self._claims),
                    action="giving back what is held and exiting without waiting for it",
                )
        self._liveness.still_working()  # the cancelled run's wait is over
        rest = self._claims.all()
        self._batches.forget(rest)
        await self._claims.give_back_within(rest, "not finished before exit")

    async def _finish_held(self, processor: asyncio.Task[None]) -> None:
        """Let the batches run while tasks wait and the time left holds the batch in hand and
        one more (each as long as the longest of the last five, or, before any, as long as the
        drain has run so far: the batch in hand has taken that at least)."""
        started = time.monotonic()
        held = len(self._batches.waiting())
        while self._batches.waiting() and not processor.done():
            now = time.monotonic()
            batch_s = self._settled.longest_recent_s(default_s=now - started)
            if self._by - now < 2 * batch_s:
                log.info(
                    "drain_giving_back",
                    waiting=len(self._batches.waiting()),
                    seconds_left=round(self._by - now, 2),
                    batch_s=round(batch_s, 3),
                )
                return
            await asyncio.sleep(min(_DRAIN_TICK_S, max(self._by - now, 0.0)))
        if held and not self._batches.waiting():
            left_s = round(self._by - time.monotonic(), 2)
            log.info("drain_finished_held", tasks=held, seconds_left=left_s)

    async def _give_back_leftovers(self, leftovers: Sequence[Delivered[Any]]) -> None:
        """What arrived after the last fetch, given back, in ``GIVE_BACK_WAIT_S`` at most."""
        if not leftovers:
            return
        why = "delivered after the last fetch"
        try:
            async with asyncio.timeout(GIVE_BACK_WAIT_S):
                for delivered in leftovers:
                    verdict = Verdict(Decision.GIVE_BACK, reason=why)
                    await self._settling.settle(delivered, verdict)
            log.info("tasks_given_back", count=len(leftovers), reason=why)
        except TimeoutError:
            log.error(
                "drain_give_back_stuck",
                count=len(leftovers),
                reason=why,
                waited_s=GIVE_BACK_WAIT_S,
                action=LEFT_FOR_ACK_WAIT,
            )
