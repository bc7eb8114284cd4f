"""Job consumers made as jobs come and deleted as they finish, never more at once than a bound
well under the server's per-stream consumer limit.

New jobs are found by one shared durable consumer, ``<WORKER_NATS__CONSUMER>-new-jobs``, on
the served pipelines' job subjects (``tasks.<pipeline>.*``), headers only: each task published
reaches one worker process once, as a few hundred bytes of headers. Of a job's messages in
hand only the latest is kept (the others are acked: a consumer that delivers it has delivered
them), its ack wait renewed, until the job's consumer, listed after the message was read, has
delivered past it or has nothing left to deliver; only then is it acked. So a task is never
left without a trace: should its consumer be deleted before delivering it and the remake fail
(below), the message in hand makes the consumer again at a later discovery, and a worker that
dies holding it gives it back after its ack wait. A job that finds no room (the bound, or the
server refusing) waits in hand likewise and gets its consumer at a later discovery, in the
order the jobs came.

A job's consumer is deleted once it has had nothing pending and nothing awaiting an ack for
``WORKER_NATS__JOB_CONSUMER_LINGER_S`` (and no max-deliveries advisory that names it waits:
it must find the consumer). Its own consumer_info, read just before the delete, must show it
still quiet, with nothing delivered since the listing. Right after the delete, the job
subject's last message is read: one published since gets a consumer again, starting after
what the deleted one had delivered, so no task falls between the two.

Delivery settings: a job consumer listed with an ack wait, delivery cap, backoff or ack and
pull limits other than this process's (made by a process started with others) is logged
``job_consumer_settings_differ`` (once per consumer), counted, and updated to ours.

The bound: ``WORKER_NATS__MAX_JOB_CONSUMERS``, and at most half of the server's per-stream
limit (the stream's ``max_consumers``, else the account's, else 1,000 as nats-server 2.15's
default), counted from the consumer listing of each discovery. Processes count alike, so a
fleet overshoots it by at most what its processes make in one discovery between them.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from dataclasses import dataclass, replace

import nats
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.errors import APIError, NotFoundError

from config.names import env_name
from config.settings import ConfigError, NatsSettings
from worker.nats.job_names import job_consumer, job_consumer_config
from worker.nats.provision import SCOUT_ACK_WAIT_S, SCOUT_BATCH, new_jobs_consumer
from worker.nats.subjects import advisory_consumer, consumer_advisory_subject

log = structlog.get_logger(__name__)
DONE_KEPT = 10_000  # deleted consumers remembered, so a late new-jobs message makes none again
ASSUMED_SERVER_LIMIT = 1000  # nats-server 2.15's per-stream default, where nothing says more
GIVEN_BACK_READ_S = 0.25  # a read for new-jobs messages given back, with none pending
_DELIVERY = ("ack_wait", "max_deliver", "backoff", "max_ack_pending", "max_waiting")


async def _settled(action: Awaitable[None]) -> None:
    try:
        await action
    except nats.errors.Error:
        pass  # the ack wait gives it back


def _seq(msg: Msg) -> int:
    return int(msg.metadata.sequence.stream)


def _delivered(info: api.ConsumerInfo) -> int:
    return int(info.delivered.stream_seq or 0) if info.delivered else 0


def _past(info: api.ConsumerInfo, seq: int) -> bool:
    """Whether the consumer ``info`` (read after task ``seq`` was stored) has delivered it,
    or has nothing left to deliver (the task gone from the stream, past its max_age)."""
    return _delivered(info) >= seq or not (info.num_pending or info.num_ack_pending)


def _same(a: object, b: object) -> bool:
    if isinstance(a, float | int) and isinstance(b, float | int):
        return abs(a - b) < 1e-3
    return a == b or (not a and not b)


@dataclass
class ConsumerStats:
    """What the lifecycle did, for the metrics and /healthz."""

    made: int = 0
    deleted: int = 0
    refused: int = 0
    existing: int = 0  # job consumers of ours, as last listed
    bound: int = 0  # the most that may exist at once
    refusal: str | None = None  # the server's last refusal, while jobs still wait for room
    updated: int = 0  # listed with other delivery settings, and given ours


class JobLifecycle:
    """Makes the consumers new jobs lack, deletes those of finished jobs, within the bound."""

    def __init__(self, js: JetStreamContext, settings: NatsSettings, pipelines: list[str]):
        self._js = js
        self._settings = settings
        self._scout: object | None = None
        self.stats = ConsumerStats(bound=settings.max_job_consumers)
        self.more = False  # the last scout read was full: discover again at once
        self._quiet_since: dict[str, float] = {}  # consumer -> when first listed with no work
        self._owed: dict[str, int] = {}  # subject -> start sequence of a remake not done yet
        self._known: set[str] = set()  # job consumers as last listed, and made since
        self._counted = 0  # job consumers that exist besides those in hand
        self._done: dict[str, int] = {}  # subject -> what its consumer deleted here delivered
        self._waiting: dict[str, Msg] = {}  # subject -> latest new-jobs message, no consumer yet
        self._held: dict[str, Msg] = {}  # subject -> the same, its consumer not yet past it
        self._differed: set[str] = set()  # consumers logged with other delivery settings
        # subject -> the latest task fetched here from the consumer make_hinted made for it,
        # before its new-jobs message was read (which is then done if that is past it)
        self._fetched: dict[str, int] = {}
        self._renewed_at = 0.0
        self._given_back_read_at = float("-inf")

    async def open(self) -> None:
        limit = await self._server_limit()
        self.stats.bound = max(1, min(self._settings.max_job_consumers, limit // 2))
        self._scout = await self._js.pull_subscribe_bind(
            durable=new_jobs_consumer(self._settings), stream=self._settings.tasks_stream
        )
        log.info("job_consumers_bounded", most_at_once=self.stats.bound)

    async def converge(self, ours: dict[str, api.ConsumerInfo]) -> None:
        """Give every existing job consumer this process's delivery settings (ack wait,
        delivery cap, backoff, ack and pull limits); ConfigError (exit 2) naming the consumer
        the server will not update."""
        wanted = job_consumer_config(self._settings, "tasks.x.x")
        for name, info in ours.items():
            if self._alike(info, wanted):
                continue
            config = replace(info.config, **{f: getattr(wanted, f) for f in _DELIVERY})
            try:
                ours[name] = await self._js.add_consumer(self._settings.tasks_stream, config)
            except APIError as error:
                raise ConfigError(
                    f"{env_name('nats', 'ack_wait_s')}, {env_name('nats', 'max_deliver')}: "
                    f"job consumer {name} on "
                    f"stream {self._settings.tasks_stream} keeps ack_wait "
                    f"{info.config.ack_wait} s and max_deliver {info.config.max_deliver}: the "
                    f"server refused the update ({error.description or error})"
                ) from None
            log.info(
                "job_consumer_updated",
                consumer=name,
                ack_wait_s=wanted.ack_wait,
                max_deliver=wanted.max_deliver,
            )

    @staticmethod
    def _alike(info: api.ConsumerInfo, wanted: api.ConsumerConfig) -> bool:
        return all(_same(getattr(info.config, f), getattr(wanted, f)) for f in _DELIVERY)

    async def align(self, ours: dict[str, api.ConsumerInfo]) -> None:
        """At each discovery: a job consumer listed with other delivery settings (made since
        the start by a process with others) is given ours, logged once per consumer and
        counted; one the server will not update is logged and left as it is."""
        wanted = job_consumer_config(self._settings, "tasks.x.x")
        for name, info in list(ours.items()):
            if self._alike(info, wanted):
                continue
            if name not in self._differed:
                self._differed.add(name)
                if len(self._differed) > DONE_KEPT:
                    self._differed.pop()
                log.warning(
                    "job_consumer_settings_differ",
                    consumer=name,
                    ack_wait_s=info.config.ack_wait,
                    max_deliver=info.config.max_deliver,
                    ours_ack_wait_s=wanted.ack_wait,
                    ours_max_deliver=wanted.max_deliver,
                    effect="updated to this process's settings",
                )
            config = replace(info.config, **{f: getattr(wanted, f) for f in _DELIVERY})
            try:
                ours[name] = await self._js.add_consumer(self._settings.tasks_stream, config)
            except APIError as error:
                log.warning("job_consumer_not_updated", consumer=name, error=str(error))
                continue
            self.stats.updated += 1

    async def _server_limit(self) -> int:
        """The stream's max_consumers, else the account's, else the assumed default."""
        info = await self._js.stream_info(self._settings.tasks_stream)
        if info.config.max_consumers and info.config.max_consumers > 0:
            return int(info.config.max_consumers)
        try:
            account = await self._js.account_info()
        except (nats.errors.Error, TimeoutError):
            return ASSUMED_SERVER_LIMIT
        limit = account.limits.max_consumers
        return int(limit) if limit and limit > 0 else ASSUMED_SERVER_LIMIT

    async def scout(self, existing: int) -> list[Msg]:
        """New-job messages waiting (none read while the bound is reached, or while a page of
        jobs waits in hand). Read only when the consumer says it has some: a read that finds
        none waits out its whole timeout, which must cover a round trip to the server."""
        self.more = False
        if self._scout is None or existing >= self.stats.bound:
            return []
        if len(self._waiting) >= SCOUT_BATCH:
            return []
        s = self._settings
        info = await self._js.consumer_info(s.tasks_stream, new_jobs_consumer(s))
        # Messages given back (a worker stopped, or died and its ack wait ran out) are awaiting
        # an ack, not pending: looked for now and then, when more await one than are in hand.
        in_hand = len(self._waiting) + len(self._held)
        given_back = (info.num_ack_pending or 0) > in_hand and (
            time.monotonic() - self._given_back_read_at >= SCOUT_ACK_WAIT_S / 3
        )
        if not info.num_pending and not given_back:
            return []
        timeout_s = s.fetch_timeout_s
        if given_back:  # ready at once if any: a short read (others may hold them all)
            self._given_back_read_at = time.monotonic()
            timeout_s = timeout_s if info.num_pending else min(timeout_s, GIVEN_BACK_READ_S)
        try:
            msgs: list[Msg] = await self._scout.fetch(SCOUT_BATCH, timeout=timeout_s)  # type: ignore[attr-defined]
        except (TimeoutError, nats.errors.TimeoutError):
            return []
        self.more = len(msgs) == SCOUT_BATCH
        return msgs

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
        self._counted = counted
        for subject, start in list(self._owed.items()):
            if await self._make(subject, ours, start=start):
                del self._owed[subject]
        for msg in scouted:
            if _seq(msg) <= self._done.get(msg.subject, 0):
                await _settled(msg.ack())  # delivered by a consumer deleted here since
            else:
                await self._keep(msg)
        if listed:  # a held job whose consumer is gone (deleted elsewhere) needs one again
            for subject in [s for s in self._held if job_consumer(self._settings, s) not in ours]:
                self._waiting[subject] = self._held.pop(subject)
        room = True
        for subject in list(self._waiting):
            name = job_consumer(self._settings, subject)
            if name not in ours and room:
                room = await self._make(subject, ours)
            if name in ours:
                self._held[subject] = self._waiting.pop(subject)
        for subject, msg in list(self._held.items()):
            info = ours.get(job_consumer(self._settings, subject))
            fetched = self._fetched.get(subject, 0) >= _seq(msg)
            if fetched or (info is not None and _past(info, _seq(msg))):
                del self._held[subject]
                await _settled(msg.ack())
        self._fetched.clear()
        if not self._waiting:
            self.stats.refusal = None
        await self._keep_in_hand()

    async def make_hinted(self, subjects: list[str], counted: int) -> dict[str, api.ConsumerInfo]:
        """The consumers of jobs heard of (``worker.nats.hints``), made (or found) before their
        new-jobs messages are read, ``counted`` others existing: ``make_missing`` then holds
        those messages until the consumers are past them. Jobs with a message in hand, or
        whose consumer was deleted here, are left to ``make_missing``; so are all once there
        is no room."""
        self._counted = counted
        ours: dict[str, api.ConsumerInfo] = {}
        for subject in subjects:
            if any(subject in hand for hand in (self._waiting, self._held, self._done, self._owed)):
                continue
            if not await self._make(subject, ours):
                break
            self._fetched.setdefault(subject, 0)
            if len(self._fetched) > DONE_KEPT:
                del self._fetched[next(iter(self._fetched))]
        return ours

    async def delivered(self, tasks: list[Msg]) -> None:
        """Tasks fetched here from job consumers: a held new-jobs message they are past is
        acked now, not at the next listing."""
        for task in tasks:
            held = self._held.get(task.subject)
            if held is not None and _seq(held) <= _seq(task):
                del self._held[task.subject]
                await _settled(held.ack())
            elif task.subject in self._fetched:
                self._fetched[task.subject] = max(self._fetched[task.subject], _seq(task))

    async def _keep(self, msg: Msg) -> None:
        """Hold ``msg``, the latest of its job's in hand; the older one is acked (a consumer
        past the latest is past it too)."""
        hand = self._held if msg.subject in self._held else self._waiting
        old = hand.get(msg.subject)
        if old is not None and _seq(old) > _seq(msg):
            await _settled(msg.ack())
            return
        hand[msg.subject] = msg
        if old is not None and _seq(old) < _seq(msg):
            await _settled(old.ack())

    async def give_back(self, scouted: list[Msg]) -> None:
        """Scouted messages a failed discovery did not take in hand, given back at once."""
        in_hand = {id(msg) for msg in [*self._waiting.values(), *self._held.values()]}
        for msg in scouted:
            if id(msg) not in in_hand:
                await _settled(msg.nak())

    async def close(self) -> None:
        """Give back the messages in hand, for another worker at once."""
        hands, self._waiting, self._held = [self._waiting, self._held], {}, {}
        for hand in hands:
            for msg in hand.values():
                await _settled(msg.nak())

    async def _keep_in_hand(self) -> None:
        """Renew the ack wait of the messages in hand (else another worker would get them
        back after SCOUT_ACK_WAIT_S)."""
        if time.monotonic() - self._renewed_at < SCOUT_ACK_WAIT_S / 3:
            return
        self._renewed_at = time.monotonic()
        for msg in [*self._waiting.values(), *self._held.values()]:
            await _settled(msg.in_progress())

    async def _make(self, subject: str, ours: dict[str, api.ConsumerInfo], start: int = 0) -> bool:
        """Make ``subject``'s consumer (from stream sequence ``start`` when given); False when
        there is no room for more now (the bound, or the server's refusal)."""
        if self._counted + len(ours) >= self.stats.bound:
            return False
        config = job_consumer_config(self._settings, subject)
        if start:
            config.deliver_policy = api.DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = start
        try:
            info = await self._js.add_consumer(self._settings.tasks_stream, config)
        except APIError as error:
            try:  # made meanwhile by another worker (with another start): that one serves
                ours[config.name or ""] = await self._js.consumer_info(
                    self._settings.tasks_stream, config.name or ""
                )
                return True
            except NotFoundError:
                self._refused(subject, error)
                return False
        ours[info.name] = info
        self.stats.refusal = None
        if info.name not in self._known:  # else add_consumer found it made: nothing new
            self._known.add(info.name)
            self.stats.made += 1
            log.info("job_consumer_made", consumer=info.name, subject=subject, start_seq=start or 1)
        return True

    def _refused(self, subject: str, error: APIError) -> None:
        """Counted each time; logged once while the refusals last (they are retried at every
        discovery)."""
        self.stats.refused += 1
        first = self.stats.refusal is None
        self.stats.refusal = (
            f"NATS refused a job consumer on stream {self._settings.tasks_stream}: "
            f"{error.description or error} (code {error.err_code}); new jobs wait for room"
        )
        (log.error if first else log.debug)(
            "job_consumer_refused",
            subject=subject,
            error=f"{error.description or error} (code {error.err_code})",
            hint="the stream's or account's max_consumers is reached (other clients' "
            "consumers count too): jobs wait until there is room",
        )

    def listed(self, ours: dict[str, api.ConsumerInfo]) -> None:
        self._known = set(ours)
        self.stats.existing = len(ours)

    async def delete_finished(self, ours: dict[str, api.ConsumerInfo], bound: set[str]) -> None:
        """Delete the consumers quiet for the linger (nothing pending, nothing awaiting an
        ack, not bound here); one whose job had a task published meanwhile is made again."""
        now = time.monotonic()
        quiet = self._quiet_since
        for name in [n for n in quiet if n not in ours]:
            del quiet[name]
        # At the bound, with jobs waiting, one discovery's quiet is linger enough.
        linger_s = 0.0 if len(ours) >= self.stats.bound else self._settings.job_consumer_linger_s
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
                await self._delete(info, ours)

    async def _named_by_advisories(self, due: list[api.ConsumerInfo]) -> set[str]:
        """The consumers of ``due`` that a max-deliveries advisory not yet settled names (its
        subject ends with the consumer's name, and it is above the advisory consumer's ack
        floor); all of them when the advisory stream cannot be read."""
        s = self._settings
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

    async def _delete(self, listed: api.ConsumerInfo, ours: dict[str, api.ConsumerInfo]) -> None:
        """Delete a consumer found quiet, unless its own consumer_info says it has delivered,
        or has work, since the listing (a process with it bound took a task meanwhile)."""
        name, subject = listed.name, listed.config.filter_subject or ""
        try:
            info = await self._js.consumer_info(self._settings.tasks_stream, name)
        except NotFoundError:
            info = listed  # another worker deleted it (and remakes what was published since)
        else:
            if info.num_pending or info.num_ack_pending or _delivered(info) != _delivered(listed):
                self._quiet_since.pop(name, None)
                return
            try:
                await self._js.delete_consumer(self._settings.tasks_stream, name)
            except NotFoundError:
                pass  # another worker deleted it
        ours.pop(name, None)
        self._known.discard(name)
        self._quiet_since.pop(name, None)
        self.stats.deleted += 1
        log.info("job_consumer_deleted", consumer=name, subject=subject)
        delivered = _delivered(info)
        self._done[subject] = delivered
        if len(self._done) > DONE_KEPT:
            del self._done[next(iter(self._done))]
        try:
            last = (await self._js.get_last_msg(self._settings.tasks_stream, subject)).seq or 0
        except NotFoundError:
            return
        # Published since the listing: served still (made at the next discovery with room).
        if subject and last > delivered and not await self._make(subject, ours, delivered + 1):
            self._owed[subject] = delivered + 1
