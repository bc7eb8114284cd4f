"""Finding jobs: the consumer listing, and the new-jobs messages read and kept in hand.

New jobs are found by one shared durable consumer, ``<WORKER_NATS__CONSUMER>-new-jobs``, on
the served pipelines' job subjects (``tasks.<pipeline>.*``), headers only: each task published
reaches one worker process once, as a few hundred bytes of headers. Of a job's messages in
hand only the latest is kept (the others are acked: a consumer that delivers it has delivered
them), its ack wait renewed: ``waiting`` while the job has no consumer, ``held`` until its
consumer, listed after the message was read, has delivered past it or has nothing left to
deliver; only then is it acked. A worker that dies holding one gives it back after its ack
wait. Making the consumers is ``worker.nats.consumer_maker``'s job; this module only keeps the
messages and says which are done.

Limits: consumers are listed 256 per request, 64 pages at most.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Mapping

import nats
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from worker.nats.consumer_stats import delivered_seq
from worker.nats.job_names import job_consumer
from worker.nats.provision import SCOUT_ACK_WAIT_S, SCOUT_BATCH
from worker.nats.subjects import ConsumerNames, new_jobs_consumer

GIVEN_BACK_READ_S = 0.25  # a read for new-jobs messages given back, with none pending
FETCHED_KEPT = 10_000  # jobs whose consumer was made on a hint, remembered at most
_PAGE = 256
_MAX_PAGES = 64


async def settled(action: Awaitable[None]) -> None:
    """An ack, nak or in-progress whose failure needs nothing: the ack wait gives it back."""
    try:
        await action
    except nats.errors.Error:
        pass  # the ack wait gives it back


def seq(msg: Msg) -> int:
    return int(msg.metadata.sequence.stream)


def _past(info: api.ConsumerInfo, task_seq: int) -> bool:
    """Whether the consumer ``info`` (read after task ``task_seq`` was stored) has delivered
    it, or has nothing left to deliver (the task gone from the stream, past its max_age)."""
    return delivered_seq(info) >= task_seq or not (info.num_pending or info.num_ack_pending)


async def list_consumers(js: JetStreamContext, stream: str) -> dict[str, api.ConsumerInfo]:
    """Every consumer of ``stream``, by name (paged)."""
    listed: dict[str, api.ConsumerInfo] = {}
    for page in range(_MAX_PAGES):
        infos = await js.consumers_info(stream, offset=page * _PAGE)
        listed.update((info.name, info) for info in infos)
        if len(infos) < _PAGE:
            break
    return listed


class JobDiscovery:
    """The new-jobs consumer's reads (each waiting ``fetch_timeout_s`` at most), and the
    messages of new jobs kept in hand."""

    def __init__(self, js: JetStreamContext, names: ConsumerNames, *, fetch_timeout_s: float):
        self._js = js
        self._names = names
        self._fetch_timeout_s = fetch_timeout_s
        self._scout: object | None = None
        self.more = False  # the last scout read was full: discover again at once
        self._waiting: dict[str, Msg] = {}  # subject -> latest new-jobs message, no consumer yet
        self._held: dict[str, Msg] = {}  # subject -> the same, its consumer not yet past it
        # subject -> the latest task fetched here from the consumer made on a hint for it,
        # before its new-jobs message was read (which is then done if that is past it)
        self._fetched: dict[str, int] = {}
        self._renewed_at = 0.0
        self._given_back_read_at = float("-inf")

    async def open(self) -> None:
        self._scout = await self._js.pull_subscribe_bind(
            durable=new_jobs_consumer(self._names), stream=self._names.tasks_stream
        )

    def in_hand(self, subject: str) -> bool:
        return subject in self._waiting or subject in self._held

    def empty_handed(self) -> bool:
        """No new-jobs message in hand: none waiting for its consumer, none held."""
        return not self._waiting and not self._held

    def waiting(self) -> list[str]:
        """The subjects of the jobs in hand with no consumer yet, in the order they came."""
        return list(self._waiting)

    def consumer_made(self, subject: str) -> None:
        """``subject``'s job has its consumer: its message is held until it is past it."""
        self._held[subject] = self._waiting.pop(subject)

    async def scout(self, existing: int, bound: int) -> list[Msg]:
        """New-job messages waiting (none read while ``existing`` reaches the ``bound``, or
        while a page of jobs waits in hand). Read only when the consumer says it has some: a
        read that finds none waits out its whole timeout, which must cover a round trip to
        the server."""
        self.more = False
        if self._scout is None or existing >= bound:
            return []
        if len(self._waiting) >= SCOUT_BATCH:
            return []
        names = self._names
        info = await self._js.consumer_info(names.tasks_stream, new_jobs_consumer(names))
        # Messages given back (a worker stopped, or died and its ack wait ran out) are awaiting
        # an ack, not pending: looked for now and then, when more await one than are in hand.
        in_hand = len(self._waiting) + len(self._held)
        given_back = (info.num_ack_pending or 0) > in_hand and (
            time.monotonic() - self._given_back_read_at >= SCOUT_ACK_WAIT_S / 3
        )
        if not info.num_pending and not given_back:
            return []
        timeout_s = self._fetch_timeout_s
        if given_back:  # ready at once if any: a short read (others may hold them all)
            self._given_back_read_at = time.monotonic()
            timeout_s = timeout_s if info.num_pending else min(timeout_s, GIVEN_BACK_READ_S)
        try:
            msgs: list[Msg] = await self._scout.fetch(SCOUT_BATCH, timeout=timeout_s)  # type: ignore[attr-defined]
        except (TimeoutError, nats.errors.TimeoutError):
            return []
        self.more = len(msgs) == SCOUT_BATCH
        return msgs

    async def keep(self, msg: Msg) -> None:
        """Hold ``msg``, the latest of its job's in hand; the older one is acked (a consumer
        past the latest is past it too)."""
        hand = self._held if msg.subject in self._held else self._waiting
        old = hand.get(msg.subject)
        if old is not None and seq(old) > seq(msg):
            await settled(msg.ack())
            return
        hand[msg.subject] = msg
        if old is not None and seq(old) < seq(msg):
            await settled(old.ack())

    def wait_again(self, ours: Mapping[str, api.ConsumerInfo]) -> None:
        """A held job whose consumer is not listed (deleted elsewhere) needs one again."""
        for subject in [s for s in self._held if job_consumer(self._names, s) not in ours]:
            self._waiting[subject] = self._held.pop(subject)

    async def ack_past(self, ours: Mapping[str, api.ConsumerInfo]) -> None:
        """Ack the held messages whose consumer, as listed in ``ours``, is past them, or
        whose task was fetched here already; forget the fetches."""
        for subject, msg in list(self._held.items()):
            info = ours.get(job_consumer(self._names, subject))
            fetched = self._fetched.get(subject, 0) >= seq(msg)
            if fetched or (info is not None and _past(info, seq(msg))):
                del self._held[subject]
                await settled(msg.ack())
        self._fetched.clear()

    def made_on_hint(self, subject: str) -> None:
        """``subject``'s consumer was made before its new-jobs message was read."""
        self._fetched.setdefault(subject, 0)
        if len(self._fetched) > FETCHED_KEPT:
            del self._fetched[next(iter(self._fetched))]

    async def delivered(self, tasks: list[Msg]) -> None:
        """Tasks fetched here from job consumers: a held new-jobs message they are past is
        acked now, not at the next listing."""
        for task in tasks:
            held = self._held.get(task.subject)
            if held is not None and seq(held) <= seq(task):
                del self._held[task.subject]
                await settled(held.ack())
            elif task.subject in self._fetched:
                self._fetched[task.subject] = max(self._fetched[task.subject], seq(task))

    async def give_back(self, scouted: list[Msg]) -> None:
        """Scouted messages a failed discovery did not take in hand, given back at once."""
        in_hand = {id(msg) for msg in [*self._waiting.values(), *self._held.values()]}
        for msg in scouted:
            if id(msg) not in in_hand:
                await settled(msg.nak())

    async def close(self) -> None:
        """Give back the messages in hand, for another worker at once."""
        hands, self._waiting, self._held = [self._waiting, self._held], {}, {}
        for hand in hands:
            for msg in hand.values():
                await settled(msg.nak())

    async def keep_in_hand(self) -> None:
        """Renew the ack wait of the messages in hand (else another worker would get them
        back after SCOUT_ACK_WAIT_S)."""
        if time.monotonic() - self._renewed_at < SCOUT_ACK_WAIT_S / 3:
            return
        self._renewed_at = time.monotonic()
        for msg in [*self._waiting.values(), *self._held.values()]:
            await settled(msg.in_progress())
