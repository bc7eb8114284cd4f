"""The dead-letter stream: a task message that names no job and task, kept with the reason
in headers, confirmed, and deduplicated by the tasks stream's sequence."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import nats
from nats.js import JetStreamContext

from config.redact import scrub, shorten
from config.settings import NatsSettings
from worker.nats.patience import patiently
from worker.nats.result_store import unavailable

_HEADER_VALUE_CHARS = 1000


class DeadLetters:
    def __init__(
        self, js: JetStreamContext, settings: NatsSettings, max_message_bytes: Callable[[], int]
    ) -> None:
        self._js = js
        self._settings = settings
        self._max_message_bytes = max_message_bytes

    async def keep(self, data: bytes, subject: str, seq: int, reason: str) -> None:
        """Publish to the dead-letter stream until it confirms, for ``store_retry_s`` at most.

        The tasks stream's sequence is the dedupe id: the worker and the advisory handler may
        both dead-letter one message, and the stream keeps it once.
        """
        headers = {
            "Nats-Msg-Id": f"dead-{self._settings.tasks_stream}-{seq}",
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
                    self._settings.dead_letter_subject,
                    data,
                    timeout=self._settings.publish_timeout_s,
                    stream=self._settings.dead_letter_stream,
                    headers=headers,
                )
            except (nats.errors.Error, TimeoutError) as error:
                raise unavailable("dead-letter stream unavailable", error) from None

        await patiently(publish, self._settings.store_retry_s)


def header_value(text: str) -> str:
    """``text`` as a header value: one printable line, capped (a newline would break the
    protocol and the server would close our connection)."""
    return shorten(scrub(text), _HEADER_VALUE_CHARS)
