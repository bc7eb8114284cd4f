"""The dead-letter stream: a task message that names no job and task, kept with the reason
in headers, confirmed, and deduplicated by the tasks stream's sequence."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import nats
from nats.js import JetStreamContext

from config.redact import scrub, shorten
from worker.nats.patience import patiently
from worker.nats.result_store import unavailable

_HEADER_VALUE_CHARS = 1000


class DeadLetters:
    """The dead-letter ``stream`` and its ``subject`` (``WORKER_NATS__DEAD_LETTER_*``), for
    messages of the ``tasks_stream``; each publish waits ``publish_timeout_s`` for its ack,
    and is retried for ``store_retry_s``."""

    def __init__(
        self,
        js: JetStreamContext,
        max_message_bytes: Callable[[], int],
        *,
        stream: str,
        subject: str,
        tasks_stream: str,
        publish_timeout_s: float,
        store_retry_s: float,
    ) -> None:
        self._js = js
        self._max_message_bytes = max_message_bytes
        self._stream = stream
        self._subject = subject
        self._tasks_stream = tasks_stream
        self._publish_timeout_s = publish_timeout_s
        self._store_retry_s = store_retry_s

    async def keep(self, data: bytes, subject: str, seq: int, reason: str) -> None:
        """Publish to the dead-letter stream until it confirms, for ``store_retry_s`` at most.

        The tasks stream's sequence is the dedupe id: the worker and the advisory handler may
        both dead-letter one message, and the stream keeps it once.
        """
        headers = {
            "Nats-Msg-Id": f"dead-{self._tasks_stream}-{seq}",
            "Worker-Reason": header_value(reason),
            "Worker-Original-Subject": header_value(subject),
            "Worker-Original-Sequence": str(seq),
        }
        limit = self._max_message_bytes()
        if len(data) > limit:
            # The copy plus our headers must fit the server's max_payload, or the server
            # drops our connection: keep the head, and say what the whole was.
            headers["Worker-Truncated-From-Bytes"] = str(len(data))
            headers["Worker-Original-Sha256"] = hashlib.sha256(data).hexdigest()
            data = data[:limit]

        async def publish() -> None:
            try:
                await self._js.publish(
                    self._subject,
                    data,
                    timeout=self._publish_timeout_s,
                    stream=self._stream,
                    headers=headers,
                )
            except (nats.errors.Error, TimeoutError) as error:
                raise unavailable("dead-letter stream unavailable", error) from None

        await patiently(publish, self._store_retry_s)


def header_value(text: str) -> str:
    """``text`` as a header value: one printable line, capped (a newline would break the
    protocol and the server would close our connection)."""
    return shorten(scrub(text), _HEADER_VALUE_CHARS)
