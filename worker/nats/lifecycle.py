"""Job consumers made as jobs come and deleted as they finish, never more at once than a bound
well under the server's per-stream consumer limit: where the four parts meet.

Each part has one job: ``worker.nats.job_discovery`` reads the new-jobs messages and keeps
them in hand, ``worker.nats.consumer_maker`` makes consumers within the bound,
``worker.nats.drift_repair`` gives existing ones this process's delivery settings, and
``worker.nats.consumer_deleter`` deletes those of finished jobs. What passes between them
lives here: a job's message in hand makes its consumer, and is acked once the consumer is
past it; a message already delivered by a consumer deleted here is only acked; a remake the
deleter owes is made first.

So a task is never left without a trace: should its consumer be deleted before delivering it
and the remake fail, the message in hand makes the consumer again at a later discovery, and a
worker that dies holding it gives it back after its ack wait. A job that finds no room (the
bound, or the server refusing) waits in hand likewise and gets its consumer at a later
discovery, in the order the jobs came.
"""

from __future__ import annotations

from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from config.settings import NatsSettings
from worker.nats.consumer_deleter import ConsumerDeleter
from worker.nats.consumer_maker import ConsumerMaker
from worker.nats.consumer_stats import ConsumerStats
from worker.nats.drift_repair import Caller, DriftRepair
from worker.nats.job_discovery import JobDiscovery, seq, settled
from worker.nats.job_names import job_consumer


class JobLifecycle:
    """Makes the consumers new jobs lack, deletes those of finished jobs, within the bound."""

    def __init__(self, js: JetStreamContext, settings: NatsSettings, pipelines: list[str]):
        self._settings = settings
        self.stats = ConsumerStats(bound=settings.max_job_consumers)
        self.discovery = JobDiscovery(js, settings)
        self.maker = ConsumerMaker(js, settings, self.stats)
        self.drift = DriftRepair(js, settings, self.stats)
        self.deleter = ConsumerDeleter(js, settings, self.stats, self.maker)

    @property
    def more(self) -> bool:
        """The last scout read was full: discover again at once."""
        return self.discovery.more

    async def open(self) -> None:
        await self.maker.open()
        await self.discovery.open()

    async def scout(self, existing: int) -> list[Msg]:
        return await self.discovery.scout(existing, self.stats.bound)

    def listed(self, ours: dict[str, api.ConsumerInfo]) -> None:
        self.maker.listed(ours)

    async def repair_drift(self, ours: dict[str, api.ConsumerInfo], caller: Caller) -> None:
        await self.drift.repair(ours, caller)

    async def make_missing(
        self,
        scouted: list[Msg],
        ours: dict[str, api.ConsumerInfo],
        counted: int = 0,
        listed: bool = True,
    ) -> None:
        """Each scouted job gets its consumer (``ours`` is listed after the scout read, or,
        not ``listed``, empty: then each is made or found by ``add_consumer``, and
        ``counted`` others exist). A job's latest message is kept in hand (its ack wait
        renewed) while it has no room, in the order they came, and then until its consumer
        is seen past it; the others are acked."""
        hand = self.discovery
        self.maker.counted = counted
        await self.maker.make_owed(ours)
        for msg in scouted:
            if seq(msg) <= self.deleter.done.get(msg.subject, 0):
                await settled(msg.ack())  # delivered by a consumer deleted here since
            else:
                await hand.keep(msg)
        if listed:
            hand.wait_again(ours)
        room = True
        for subject in list(hand.waiting):
            name = job_consumer(self._settings, subject)
            if name not in ours and room:
                room = await self.maker.make(subject, ours)
            if name in ours:
                hand.held[subject] = hand.waiting.pop(subject)
        await hand.ack_past(ours)
        if not hand.waiting:
            self.stats.refusal = None
        await hand.keep_in_hand()

    async def make_hinted(self, subjects: list[str], counted: int) -> dict[str, api.ConsumerInfo]:
        """The consumers of jobs heard of (``worker.nats.hints``), made (or found) before their
        new-jobs messages are read, ``counted`` others existing: ``make_missing`` then holds
        those messages until the consumers are past them. Jobs with a message in hand, or
        whose consumer was deleted here, are left to ``make_missing``; so are all once there
        is no room."""
        self.maker.counted = counted
        ours: dict[str, api.ConsumerInfo] = {}
        for subject in subjects:
            if (
                self.discovery.in_hand(subject)
                or subject in self.deleter.done
                or subject in self.maker.owed
            ):
                continue
            if not await self.maker.make(subject, ours):
                break
            self.discovery.made_on_hint(subject)
        return ours

    async def delivered(self, tasks: list[Msg]) -> None:
        await self.discovery.delivered(tasks)

    async def give_back(self, scouted: list[Msg]) -> None:
        await self.discovery.give_back(scouted)

    async def close(self) -> None:
        await self.discovery.close()

    async def delete_finished(self, ours: dict[str, api.ConsumerInfo], bound: set[str]) -> None:
        await self.deleter.delete_finished(ours, bound)
