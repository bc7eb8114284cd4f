"""Tasks whose deliveries ran out with their worker still get exactly one result.

When the last delivery of a task dies with its worker (killed, wedged, restarted), no live
worker sees the task again. JetStream then publishes a max-deliveries advisory; provision
keeps those advisories in a stream, and every worker pulls them from one shared durable
consumer and reads the original task by its stream sequence; what becomes of it (an
``error`` result, create-if-absent, or a dead letter) is the settler's
(``worker.nats.settle.NatsSettler.exhausted``). This module only pulls, reads and paces advisories.

An advisory is checked before it is acted on: its type, stream and consumer must be the
server's, its deliveries at least the consumer's max_deliver, and its task one the consumer has
delivered; anything else is refused (terminated, logged ``advisory_refused``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from dataclasses import dataclass

import nats
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerInfo, RawStreamMsg
from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError

from worker.nats.job_names import is_job_consumer
from worker.nats.settle import NatsSettler
from worker.nats.subjects import ConsumerNames, advisory_consumer

log = structlog.get_logger(__name__)
MAX_DELIVER_TYPE = "io.nats.jetstream.advisory.v1.max_deliver"
POISON_ATTEMPTS = 10  # an advisory that fails this often for reasons of its own is dropped
_FAILURES_KEPT = 1000


async def _settle_advisory(action: Awaitable[None]) -> None:
    """Ack, nak or term; if the connection is gone, the ack wait brings the advisory back."""
    try:
        await action
    except nats.errors.Error:
        pass


class ExhaustedTasks:
    """Pulls max-deliveries advisories (each pull waiting ``fetch_timeout_s`` at most) and
    stores the results nobody else will; an advisory given back waits as the ``settler``'s
    backoff says."""

    def __init__(
        self,
        js: JetStreamContext,
        names: ConsumerNames,
        settler: NatsSettler,
        *,
        fetch_timeout_s: float,
    ) -> None:
        self._js = js
        self._names = names
        self._settler = settler
        self._fetch_timeout_s = fetch_timeout_s
        self._sub: object | None = None
        self._failures: dict[int, int] = {}  # advisory sequence -> unexpected failures

    async def run(self, stop: asyncio.Event) -> None:
        sub = await self._js.pull_subscribe_bind(
            durable=advisory_consumer(self._names), stream=self._names.advisory_stream
        )
        try:
            while not stop.is_set():
                try:
                    msgs = await sub.fetch(16, timeout=self._fetch_timeout_s)
                except (TimeoutError, nats.errors.TimeoutError):
                    continue
                except nats.errors.Error as error:
                    log.warning("advisory_fetch_failed", error=str(error))
                    await asyncio.sleep(self._fetch_timeout_s)
                    continue
                for msg in msgs:
                    await self._handle_safely(msg)
        finally:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                pass

    async def _handle_safely(self, msg: Msg) -> None:
        """The per-advisory boundary: a failure is logged and the advisory retried later; one
        that fails POISON_ATTEMPTS times (outages not counted) is dropped. The handler never
        dies of one advisory."""
        try:
            await self.handle(msg)
        except Exception:
            key = msg.metadata.sequence.stream
            failures = self._failures[key] = self._failures.get(key, 0) + 1
            if len(self._failures) > _FAILURES_KEPT:
                self._failures.pop(next(iter(self._failures)))
            if failures >= POISON_ATTEMPTS:
                log.exception("advisory_given_up", failures=failures, data=msg.data[:200])
                self._failures.pop(key, None)
                await _settle_advisory(msg.term())
            else:
                log.exception("advisory_handling_failed", failures=failures, data=msg.data[:200])
                await _settle_advisory(msg.nak(delay=self._settler.backoff.max_s))

    async def _later(self, msg: Msg) -> None:
        """An outage (store or stream): try again with backoff, as long as it lasts."""
        delay_s = self._settler.backoff.delay_s(msg.metadata.num_delivered)
        await _settle_advisory(msg.nak(delay=delay_s))

    async def handle(self, msg: Msg) -> None:
        """One advisory: the settler settles the original task (``NatsSettler.exhausted``);
        the advisory is acked once they have, and comes back later when the store did not
        confirm."""
        read = _read_advisory(msg.data)
        if read is None:
            log.error("advisory_unreadable", data=msg.data[:200])
            await msg.term()
            return
        seq, deliveries = read.stream_seq, read.deliveries
        original = await self._original(msg, seq)
        if original is None:
            return
        forged = await self._forged(msg, read, original.subject or "")
        if forged is None:
            return  # an outage, or the task still in flight: it comes back later
        if forged:
            log.error("advisory_refused", stream_seq=seq, reason=forged, data=msg.data[:200])
            await msg.term()
            return
        data, subject = original.data or b"", original.subject or ""
        if await self._settler.exhausted(data, subject, seq, deliveries):
            await msg.ack()
        else:
            await self._later(msg)

    async def _forged(self, msg: Msg, advisory: Advisory, subject: str) -> str | None:
        """Why ``advisory`` cannot be the server's, against its own fields and the named
        consumer's state now; "" when it can be; None when it is given back for later (the
        state could not be read, or the task is still awaiting an ack there). A client
        allowed to publish on the advisory subject could otherwise fail any task by its
        sequence: deployments deny it (docs/operating.md, "NATS permissions"); what passes names a
        consumer whose filter takes the task's subject, that has delivered it, at least as
        often as its max_deliver, and holds it no longer (the server drops a task from the
        pending ones when its deliveries run out: an acked or dropped task is below the ack
        floor)."""
        s = self._names
        ours = advisory.consumer == s.consumer or is_job_consumer(s, advisory.consumer)
        if (advisory.type, advisory.stream) != (MAX_DELIVER_TYPE, s.tasks_stream) or not ours:
            return (
                f"names type {advisory.type!r}, stream {advisory.stream!r} and consumer "
                f"{advisory.consumer!r}; the server writes {MAX_DELIVER_TYPE!r}, "
                f"{s.tasks_stream!r} and {s.consumer!r} or one of its job consumers"
            )
        try:
            info = await self._js.consumer_info(s.tasks_stream, advisory.consumer)
        except NotFoundError:
            return f"consumer {advisory.consumer!r} does not exist"
        except (nats.errors.Error, TimeoutError):
            await self._later(msg)
            return None
        return await self._against(msg, advisory, subject, info)

    async def _against(
        self, msg: Msg, advisory: Advisory, subject: str, info: ConsumerInfo
    ) -> str | None:
        """``_forged``'s checks against the named consumer's ``info``."""
        max_deliver = int(info.config.max_deliver or 0)
        if advisory.deliveries < max_deliver:
            return f"{advisory.deliveries} deliveries, fewer than the consumer's {max_deliver}"
        filters = info.config.filter_subjects or [info.config.filter_subject or ">"]
        if not any(_matches(f, subject) for f in filters):
            return f"consumer {advisory.consumer!r} does not take {subject!r} (filter {filters})"
        delivered_seq = int(info.delivered.stream_seq or 0) if info.delivered else 0
        if advisory.stream_seq > delivered_seq:
            return (
                f"stream sequence {advisory.stream_seq} was never delivered (the consumer has "
                f"delivered up to {delivered_seq})"
            )
        floor = int(info.ack_floor.stream_seq or 0) if info.ack_floor else 0
        if advisory.stream_seq > floor and info.num_ack_pending:
            log.warning(
                "advisory_deferred",
                stream_seq=advisory.stream_seq,
                reason=f"consumer {advisory.consumer!r} may still hold it (ack floor {floor})",
            )
            await self._later(msg)
            return None
        return ""

    async def _original(self, msg: Msg, seq: int) -> RawStreamMsg | None:
        """The task message the advisory names; None once the advisory is settled here."""
        try:
            return await self._js.get_msg(self._names.tasks_stream, seq)
        except NotFoundError:
            log.error("exhausted_task_gone", stream_seq=seq, hint="raise the tasks stream max_age")
            await msg.ack()
        except ServiceUnavailableError:
            await self._later(msg)
        except APIError as error:  # the server refuses this request as such: never retried
            log.error("advisory_refused_by_server", stream_seq=seq, error=str(error))
            await msg.term()
        except nats.errors.Error:
            await self._later(msg)
        return None


def _matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` one token, ``>`` the rest."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)


@dataclass(frozen=True)
class Advisory:
    """The fields of a max-deliveries advisory this handler acts on."""

    stream_seq: int
    deliveries: int
    type: str
    stream: str
    consumer: str


def _read_advisory(data: bytes) -> Advisory | None:
    """A max-deliveries advisory's fields; None if unreadable."""
    try:
        advisory = json.loads(data)
        seq, deliveries = int(advisory["stream_seq"]), int(advisory["deliveries"])
        names = [advisory.get(key) for key in ("type", "stream", "consumer")]
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None
    if not 1 <= seq < 2**64 or not all(isinstance(name, str) for name in names):
        return None
    return Advisory(seq, deliveries, *names)
