"""Tasks whose deliveries ran out with their worker still get exactly one result.

When the last delivery of a task dies with its worker (killed, wedged, restarted), no live
worker sees the task again. JetStream then publishes a max-deliveries advisory; provision
keeps those advisories in a stream, and every worker pulls them from one shared durable
consumer and reads the original task by its stream sequence; what becomes of it (an
``error`` result, create-if-absent, or a dead letter) is the delivery rules' decision
(``worker.settle.Settler.exhausted``). This module only pulls, reads and paces advisories.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable

import nats
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg
from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError

from config.settings import NatsSettings
from worker.nats.subjects import advisory_consumer
from worker.settle import Settler, backoff_s

log = structlog.get_logger(__name__)
POISON_ATTEMPTS = 10  # an advisory that fails this often for reasons of its own is dropped
_FAILURES_KEPT = 1000


async def _settle_advisory(action: Awaitable[None]) -> None:
    """Ack, nak or term; if the connection is gone, the ack wait brings the advisory back."""
    try:
        await action
    except nats.errors.Error:
        pass


class ExhaustedTasks:
    """Pulls max-deliveries advisories and stores the results nobody else will."""

    def __init__(self, js: JetStreamContext, settings: NatsSettings, settler: Settler) -> None:
        self._js = js
        self._settings = settings
        self._settler = settler
        self._sub: object | None = None
        self._failures: dict[int, int] = {}  # advisory sequence -> unexpected failures

    async def run(self, stop: asyncio.Event) -> None:
        sub = await self._js.pull_subscribe_bind(
            durable=advisory_consumer(self._settings), stream=self._settings.advisory_stream
        )
        try:
            while not stop.is_set():
                try:
                    msgs = await sub.fetch(16, timeout=self._settings.fetch_timeout_s)
                except (TimeoutError, nats.errors.TimeoutError):
                    continue
                except nats.errors.Error as error:
                    log.warning("advisory_fetch_failed", error=str(error))
                    await asyncio.sleep(self._settings.fetch_timeout_s)
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
                await _settle_advisory(msg.nak(delay=self._settings.nak_backoff_max_s))

    async def _later(self, msg: Msg) -> None:
        """An outage (store or stream): try again with backoff, as long as it lasts."""
        delay_s = backoff_s(
            msg.metadata.num_delivered,
            self._settings.nak_backoff_base_s,
            self._settings.nak_backoff_max_s,
        )
        await _settle_advisory(msg.nak(delay=delay_s))

    async def handle(self, msg: Msg) -> None:
        """One advisory: the delivery rules settle the original task (``Settler.exhausted``);
        the advisory is acked once they have, and comes back later when the store did not
        confirm."""
        read = _read_advisory(msg.data)
        if read is None:
            log.error("advisory_unreadable", data=msg.data[:200])
            await msg.term()
            return
        seq, deliveries = read
        original = await self._original(msg, seq)
        if original is None:
            return
        data, subject = original.data or b"", original.subject or ""
        if await self._settler.exhausted(data, subject, seq, deliveries):
            await msg.ack()
        else:
            await self._later(msg)

    async def _original(self, msg: Msg, seq: int) -> RawStreamMsg | None:
        """The task message the advisory names; None once the advisory is settled here."""
        try:
            return await self._js.get_msg(self._settings.tasks_stream, seq)
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


def _read_advisory(data: bytes) -> tuple[int, int] | None:
    """(stream sequence, deliveries) of a max-deliveries advisory; None if unreadable."""
    try:
        advisory = json.loads(data)
        seq, deliveries = int(advisory["stream_seq"]), int(advisory["deliveries"])
    except (ValueError, KeyError, TypeError, RecursionError):
        return None
    return (seq, deliveries) if 1 <= seq < 2**64 else None
