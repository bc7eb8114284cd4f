"""Claims: the tasks this process took from its source and has not yet settled (their result
kept, left for another delivery, or given back): "held tasks" in the settings, the logs and the
metrics; a ``Claim`` is one held task.

It owns the held map, the room left under the cap (``max_held_tasks``, which bounds host
memory for loaded images), the liveness count, and the ack-wait keep-alive. A held task whose
batch has run (``inferred``) holds no image any more, only its result until it is settled, so
it takes no room: the next batch's tasks are fetched and read while one is settled (an Antenna
result post is a round trip to Antenna, a WAN's away). The processor settles up to two batches at
once (``batches.SETTLES_IN_FLIGHT``), so at most two batches more than the cap are held (the
second one waiting for a settle to end); up to the cap more only when a
pipeline's models cannot be loaded and every task of it waiting gets its error result at once
(those hold no image either).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog

from worker.core.ports import Delivered, Settler
from worker.core.tasks import Task
from worker.core.verdicts import Decision, Verdict
from worker.health.liveness import Liveness

log = structlog.get_logger(__name__)
# A give-back is no network round trip (a nak per task, a local note), but nats-py's publish
# waits for a forced flush once its pending buffer is full, which a hung connection (a frozen
# server) never drains: each give-back of a drain is bounded by this, and what it could not give
# back comes back after its ack wait (or its reservation's TTR).
GIVE_BACK_WAIT_S = 5.0
LEFT_FOR_ACK_WAIT = (
    "exiting without them: they come back after their ack wait (NATS) or their "
    "reservation's TTR (Antenna)"
)


@dataclass
class Claim:
    """A task fetched and not yet settled."""

    delivered: Delivered[Any]
    task: Task
    key: int
    fetched_at: float


class Claims:
    def __init__(
        self,
        max_held: int,
        liveness: Liveness,
        settler: Settler[Any],
        parked: Callable[[str], bool] = lambda _pipeline: False,
        parked_max: int = 0,
    ) -> None:
        self.max_held = max_held
        # Held tasks of unavailable pipelines (``parked``: on their last delivery, waiting for
        # it to load) take no room up to ``parked_max`` (one batch): else they would fill the
        # room and this host would serve no pipeline. Bounded, as their images are loaded.
        self._parked = parked
        self.parked_max = parked_max
        self._liveness = liveness
        self._settler = settler  # the source's: gives back, keeps alive
        self._held: dict[int, Claim] = {}
        self._inferred: set[int] = set()  # keys of held tasks whose batch has run
        self._keys = itertools.count()
        self._space = asyncio.Event()

    def __len__(self) -> int:
        return len(self._held)

    def room(self) -> int:
        """Tasks that may be fetched now: the cap less the held tasks still to load or run."""
        held = len(self._held) - len(self._inferred)
        return self.max_held - held + min(self.parked_max, self.parked())

    def parked(self) -> int:
        """Held tasks, their batch not run, of pipelines unavailable now."""
        return sum(
            1
            for key, held in self._held.items()
            if key not in self._inferred and self._parked(held.task.pipeline)
        )

    def parked_full(self) -> bool:
        """No more task of an unavailable pipeline may be held outside the room."""
        return self.parked() >= self.parked_max

    def inferred(self, done: list[Claim]) -> None:
        """``done``'s batch has run: they wait for their settling only, and take no room."""
        self._inferred.update(held.key for held in done if held.key in self._held)
        self._space.set()

    async def wait_for_room(self, timeout_s: float) -> None:
        """Until a task is released, or ``timeout_s``."""
        self._space.clear()
        if self.room() > 0:
            return
        try:
            await asyncio.wait_for(self._space.wait(), timeout_s)
        except TimeoutError:
            pass

    def add(self, delivered: Delivered[Any], task: Task) -> Claim:
        held = Claim(delivered, task, next(self._keys), time.monotonic())
        self._held[held.key] = held
        self._liveness.set_held(len(self._held))
        return held

    def all(self) -> list[Claim]:
        return list(self._held.values())

    def release(self, done: list[Claim]) -> None:
        for held in done:
            self._held.pop(held.key, None)
            self._inferred.discard(held.key)
        self._liveness.set_held(len(self._held))
        self._space.set()

    async def keep_alive(self) -> None:
        """A batch completed: extend the ack wait of everything still held, and only then."""
        for held in self.all():
            await best_effort(self._settler.keep_alive(held.delivered))

    async def give_back(self, held: list[Claim], reason: str) -> None:
        """Given back now (the source's settler: a nak, or a note that Antenna delivers it
        again), so the tasks are redelivered at once (to another worker, on a drain)."""
        if not held:
            return
        for h in held:
            await self._settler.settle(h.delivered, Verdict(Decision.GIVE_BACK, reason=reason))
        self.release(held)
        ids = [h.task.id for h in held]
        log.info("tasks_given_back", count=len(held), reason=reason, task_ids=ids)

    async def give_back_within(self, held: list[Claim], reason: str) -> None:
        """``held`` given back (``give_back``), in ``GIVE_BACK_WAIT_S`` at most: a nak can hang
        on a hung connection, and a drain must end. When it did not end, its tasks are named
        (the first ones may have been given back) and released; the others come back after
        their ack wait (or their reservation's TTR)."""
        try:
            await asyncio.wait_for(self.give_back(held, reason), GIVE_BACK_WAIT_S)
        except TimeoutError:
            ids = [h.task.id for h in held]
            log.error(
                "drain_give_back_stuck",
                count=len(held),
                task_ids=ids,
                reason=reason,
                waited_s=GIVE_BACK_WAIT_S,
                action=LEFT_FOR_ACK_WAIT,
            )
            self.release(held)


async def keep_alive_while_advancing(
    claims: Claims,
    last_progress: Callable[[], float],
    engine_busy: Callable[[], bool],
    stop: asyncio.Event,
    tick_s: float,
) -> None:
    """Until ``stop``: every ``tick_s``, while a batch runs and work advanced since the last
    look (a forward pass ended: ``Liveness.last_progress`` moved), the held tasks' ack waits
    are extended, so a long batch that advances is never delivered again under itself; one
    that stopped advancing is not kept alive, and its tasks come back after the ack wait."""
    seen = last_progress()
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), tick_s)
        if stop.is_set():
            return
        now = last_progress()
        if engine_busy() and now != seen:
            await claims.keep_alive()
        seen = now


async def best_effort(action: Awaitable[None]) -> None:
    """Await a keep-alive; one that fails can only have failed in the transport
    (connection gone, timeout), and then the ack wait brings the message back anyway."""
    try:
        await action
    except Exception as error:  # noqa: BLE001 - see above; nothing is lost
        log.warning("settle_action_failed", error=f"{type(error).__name__}: {error}")
