"""Job consumers made as jobs come and deleted as they finish, never more at once than a bound
well under the server's per-stream consumer limit: where the four parts meet.

Each part has one job: ``worker.nats.job_discovery`` reads the new-jobs messages and keeps
them in hand, ``worker.nats.consumer_maker`` makes consumers within the bound,
``worker.nats.drift_repair`` gives existing ones this process's delivery settings, and
``worker.nats.consumer_deleter`` deletes those of finished jobs. What they know of the job
consumers (the map of this round, the bound, the remakes owed, what the deleted ones had
delivered, the counts) is ``worker.nats.job_state``'s, which each asks and tells; none writes
another's. What passes between them lives here: a job's message in hand makes its consumer,
and is acked once the consumer is past it; a message already delivered by a consumer deleted
here is only acked; a remake the deleter owes is made first.

So a task is never left without a trace: should its consumer be deleted before delivering it
and the remake fail, the message in hand makes the consumer again at a later discovery, and a
worker that dies holding it gives it back after its ack wait. A job that finds no room (the
bound, or the server refusing) waits in hand likewise and gets its consumer at a later
discovery, in the order the jobs came.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from worker.nats.consumer_deleter import ConsumerDeleter
from worker.nats.consumer_maker import ConsumerMaker
from worker.nats.consumer_stats import ConsumerStats
from worker.nats.drift_repair import Caller, DriftRepair
from worker.nats.job_discovery import JobDiscovery, seq, settled
from worker.nats.job_names import job_consumer
from worker.nats.job_state import JobConsumerState
from worker.nats.subjects import ConsumerNames


class JobLifecycle:
    """Makes the consumers new jobs lack, deletes those of finished jobs, within the bound.

    Each part gets what it uses: the ``names``, each job subject's consumer as ``config_of``
    makes it, at most ``most`` at once, deleted after ``linger_s`` quiet; new-jobs reads wait
    ``fetch_timeout_s`` at most (``worker.nats.job_consumers.job_lifecycle`` builds it from
    the settings)."""

    def __init__(
        self,
        js: JetStreamContext,
        names: ConsumerNames,
        *,
        config_of: Callable[[str], api.ConsumerConfig],
        most: int,
        linger_s: float,
        fetch_timeout_s: float,
    ):
        self._names = names
        self._state = JobConsumerState(bound=most)
        self._discovery = JobDiscovery(js, names, fetch_timeout_s=fetch_timeout_s)
        stream = names.tasks_stream
        self._maker = ConsumerMaker(js, self._state, stream=stream, config_of=config_of, most=most)
        self._drift = DriftRepair(js, self._state, stream=stream, config_of=config_of)
        self._deleter = ConsumerDeleter(
            js, self._state, self._maker, names=names, linger_s=linger_s
        )

    @property
    def more(self) -> bool:
        """The last scout read was full: discover again at once."""
        return self._discovery.more

    @property
    def stats(self) -> ConsumerStats:
        """What the lifecycle did, for the metrics (a copy)."""
        return self._state.stats

    @property
    def refusal(self) -> str | None:
        """The server's last refusal, while new jobs still wait for room."""
        return self._state.refusal

    @property
    def consumers(self) -> Mapping[str, api.ConsumerInfo]:
        """This round's job consumers of ours, by name (read-only)."""
        return self._state.consumers

    def empty_handed(self) -> bool:
        """No new-jobs message in hand (``JobDiscovery.empty_handed``)."""
        return self._discovery.empty_handed()

    async def open(self) -> None:
        await self._maker.open()
        await self._discovery.open()

    async def scout(self) -> list[Msg]:
        return await self._discovery.scout(self._state.existing, self._state.bound)

    def listed(self, ours: Mapping[str, api.ConsumerInfo]) -> None:
        """A round after a listing: ``ours``, the job consumers listed, are all there are."""
        self._state.listed(ours)

    def round_done(self) -> None:
        """The round's made and deleted counted in how many exist."""
        self._state.round_done()

    async def repair_at_open(self, listed: Mapping[str, api.ConsumerInfo]) -> None:
        """Every job consumer ``listed`` given this process's delivery settings."""
        await self._drift.repair(listed, Caller.OPEN)

    async def repair_drift(self) -> None:
        """This round's job consumers given this process's delivery settings."""
        self._state.updated(await self._drift.repair(self._state.consumers, Caller.DISCOVERY))

    async def make_missing(
        self, scouted: list[Msg], known: Mapping[str, api.ConsumerInfo] | None = None
    ) -> None:
        """Each scouted job gets its consumer: after a listing (``listed``), or, with
        ``known`` (those made on hints since), in a round of its own with no listing, where
        each is made or found by ``add_consumer`` and the others last counted still exist. A
        job's latest message is kept in hand (its ack wait renewed) while it has no room, in
        the order they came, and then until its consumer is seen past it; the others are
        acked."""
        state, hand = self._state, self._discovery
        if known is not None:
            state.unlisted(known, others=max(0, state.existing - len(known)))
        await self._maker.make_owed()
        for msg in scouted:
            if seq(msg) <= state.delivered_by_deleted(msg.subject):
                await settled(msg.ack())  # delivered by a consumer deleted here since
            else:
                await hand.keep(msg)
        if known is None:
            hand.wait_again(state.consumers)
        room = True
        for subject in hand.waiting():
            name = job_consumer(self._names, subject)
            if name not in state.consumers and room:
                room = await self._maker.make(subject)
            if name in state.consumers:
                hand.consumer_made(subject)
        await hand.ack_past(state.consumers)
        if not hand.waiting():
            state.refusal_over()
        await hand.keep_in_hand()

    async def make_hinted(self, subjects: list[str]) -> dict[str, api.ConsumerInfo]:
        """The consumers of jobs heard of (``worker.nats.hints``), made (or found) before their
        new-jobs messages are read, in a round with no listing (those last counted exist):
        ``make_missing`` then holds those messages until the consumers are past them. Jobs
        with a message in hand, or whose consumer was deleted here, are left to
        ``make_missing``; so are all once there is no room."""
        state = self._state
        state.unlisted({}, others=state.existing)
        for subject in subjects:
            if (
                self._discovery.in_hand(subject)
                or state.deleted_here(subject)
                or state.owes(subject)
            ):
                continue
            if not await self._maker.make(subject):
                break
            self._discovery.made_on_hint(subject)
        return dict(state.consumers)

    async def delivered(self, tasks: list[Msg]) -> None:
        await self._discovery.delivered(tasks)

    async def give_back(self, scouted: list[Msg]) -> None:
        await self._discovery.give_back(scouted)

    async def close(self) -> None:
        await self._discovery.close()

    async def delete_finished(self, bound: set[str]) -> None:
        """The consumers of this round's finished jobs deleted (none ``bound`` here)."""
        await self._deleter.delete_finished(bound)
