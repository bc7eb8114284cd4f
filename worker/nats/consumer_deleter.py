"""Deleting the consumers of finished jobs.

A job's consumer is deleted once it has had nothing pending and nothing awaiting an ack for
``WORKER_NATS__JOB_CONSUMER_LINGER_S`` (no linger at the bound), is not bound here, and no
max-deliveries advisory that names it waits (it must find the consumer). Its own
consumer_info, read just before the delete, must show it still quiet, with nothing delivered
since the listing. Right after the delete, the job subject's last message is read: one
published since gets a consumer again (``worker.nats.consumer_maker``), starting after what
the deleted one had delivered, so no task falls between the two; without room, the remake is
owed to the next discovery.
"""

from __future__ import annotations

import time

import nats
import structlog
from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError

from worker.nats.consumer_maker import ConsumerMaker
from worker.nats.consumer_stats import delivered_seq
from worker.nats.job_state import JobConsumerState
from worker.nats.subjects import ConsumerNames, advisory_consumer, consumer_advisory_subject

log = structlog.get_logger(__name__)


class ConsumerDeleter:
    """Deletes the consumers quiet for ``linger_s`` (``WORKER_NATS__JOB_CONSUMER_LINGER_S``);
    the state remembers what each delivered."""

    def __init__(
        self,
        js: JetStreamContext,
        state: JobConsumerState,
        maker: ConsumerMaker,
        *,
        names: ConsumerNames,
        linger_s: float,
    ):
        self._js = js
        self._state = state
        self._maker = maker
        self._names = names
        self._linger_s = linger_s
        self._quiet_since: dict[str, float] = {}  # consumer -> when first listed with no work

    async def delete_finished(self, bound: set[str]) -> None:
        """Delete the consumers of the state's map quiet for the linger (nothing pending,
        nothing awaiting an ack, not bound here); one whose job had a task published
        meanwhile is made again."""
        now = time.monotonic()
        ours = self._state.consumers
        quiet = self._quiet_since
        for name in [n for n in quiet if n not in ours]:
            del quiet[name]
        # At the bound, with jobs waiting, one discovery's quiet is linger enough.
        linger_s = 0.0 if len(ours) >= self._state.bound else self._linger_s
        due = []
        for name, info in ours.items():
            if info.num_pending or info.num_ack_pending or name in bound:
                quiet.pop(name, None)
            elif name in quiet and now - quiet[name] >= linger_s:
                due.append(info)
            else:
                quiet.setdefault(name, now)
        if not due:
            return
        named = await self._named_by_advisories(due)
        for info in due:
            if info.name not in named:
                await self._delete(info)

    async def _named_by_advisories(self, due: list[api.ConsumerInfo]) -> set[str]:
        """The consumers of ``due`` that a max-deliveries advisory not yet settled names (its
        subject ends with the consumer's name, and it is above the advisory consumer's ack
        floor); all of them when the advisory stream cannot be read."""
        s = self._names
        every = {info.name for info in due}
        try:
            info = await self._js.consumer_info(s.advisory_stream, advisory_consumer(s))
        except (nats.errors.Error, TimeoutError):
            return every
        if not (info.num_pending or info.num_ack_pending):
            return set()
        floor = int(info.ack_floor.stream_seq or 0) if info.ack_floor else 0
        named = set()
        for name in every:
            subject = consumer_advisory_subject(s, name)
            try:
                last = await self._js.get_last_msg(s.advisory_stream, subject)
            except NotFoundError:
                continue
            except (nats.errors.Error, TimeoutError):
                named.add(name)
                continue
            if (last.seq or 0) > floor:
                named.add(name)
        return named

    async def _delete(self, listed: api.ConsumerInfo) -> None:
        """Delete a consumer found quiet, unless its own consumer_info says it has delivered,
        or has work, since the listing (a process with it bound took a task meanwhile)."""
        name, subject = listed.name, listed.config.filter_subject or ""
        try:
            info = await self._js.consumer_info(self._names.tasks_stream, name)
        except NotFoundError:
            info = listed  # another worker deleted it (and remakes what was published since)
        else:
            if (
                info.num_pending
                or info.num_ack_pending
                or delivered_seq(info) != delivered_seq(listed)
            ):
                self._quiet_since.pop(name, None)
                return
            try:
                await self._js.delete_consumer(self._names.tasks_stream, name)
            except NotFoundError:
                pass  # another worker deleted it
        self._state.deleted(name, subject, delivered_seq(info))
        self._quiet_since.pop(name, None)
        log.info("job_consumer_deleted", consumer=name, subject=subject)
        await self._remake_if_published(subject, delivered_seq(info))

    async def _remake_if_published(self, subject: str, delivered: int) -> None:
        """A task published on ``subject`` since its consumer delivered ``delivered`` gets a
        consumer again from there (or is owed one, with no room now)."""
        try:
            last = (await self._js.get_last_msg(self._names.tasks_stream, subject)).seq or 0
        except NotFoundError:
            return
        # Published since the listing: served still (made at the next discovery with room).
        if subject and last > delivered and not await self._maker.make(subject, delivered + 1):
            self._state.owe(subject, delivered + 1)
