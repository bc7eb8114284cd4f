"""Whether JetStream answers its requests, apart from whether the connection is up.

A connection that answers pings can carry requests no JetStream answers: a cluster that lost
its quorum (two of three nodes gone) has no leader for any replicated stream or consumer, so
every fetch is answered 503 at once and every store or consumer info times out, while the node
left answers pings. The feed and the results store report each request's outcome here: one
that JetStream answered (messages, a PubAck, a refusal with a reason) clears the clock, one it
could not answer (503, no responders, a 5xx API error, a request timeout) starts it. A fetch
that times out with nothing is neither: an idle stream's fetch times out too. Errors of the
connection itself (closed, reconnecting) are neither: ``worker.nats.connection`` says those.

While the clock runs, ``probe`` asks the tasks consumer's info once a second, so an idle worker
(whose fetches only time out) is ready again as soon as JetStream answers; while it does not
run, ``probe`` asks nothing. Knows nothing of torch or the core.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import nats
from nats.js.errors import APIError, NoStreamResponseError, ServiceUnavailableError

PROBE_EVERY_S = 1.0
PROBE_TIMEOUT_S = 2.0  # a leader answers a consumer info in milliseconds
_UNAVAILABLE = (ServiceUnavailableError, NoStreamResponseError, nats.errors.NoRespondersError)
_CONNECTION = (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError)


def unanswered(error: BaseException) -> bool:
    """Whether ``error`` says JetStream could not answer (no leader, no quorum, no responder),
    as opposed to an answer that refused, or a connection that is down."""
    if isinstance(error, _UNAVAILABLE):
        return True
    if isinstance(error, APIError):
        return (error.code or 0) >= 500
    if isinstance(error, _CONNECTION):
        return False
    return isinstance(error, TimeoutError)  # nats-py's own subclasses it


class JetStreamAnswers:
    """When JetStream's requests started failing (None while it answers), and the last failure."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.failing_since: float | None = None
        self.last_failure = ""

    def answered(self) -> None:
        self.failing_since = None

    def failed(self, what: str, error: BaseException) -> None:
        """A request (``what``: fetch, store, ...) ended with ``error``: the clock starts when
        it says JetStream could not answer; an answer that refused clears it."""
        if not unanswered(error):
            if isinstance(error, APIError):
                self.answered()
            return
        self.last_failure = f"{what}: {type(error).__name__}"
        if self.failing_since is None:
            self.failing_since = self._clock()

    def problem(self, timeout_s: float) -> str | None:
        """Why /readyz answers 503: no request answered for ``timeout_s`` or longer."""
        since = self.failing_since
        if since is None or self._clock() - since < timeout_s:
            return None
        return (
            f"nats: JetStream has answered no request for {self._clock() - since:.0f}s "
            f"(timeout {timeout_s:g}s; last {self.last_failure}), the connection up: no leader "
            "for the streams or consumers (a cluster that lost its quorum?)"
        )

    async def probe(self, ask: Callable[[], Awaitable[object]], stop: asyncio.Event) -> None:
        """Until ``stop``: while failing, ``ask`` (a request JetStream's leader answers) once
        every ``PROBE_EVERY_S``, its outcome reported. Never raises."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), PROBE_EVERY_S)
            if self.failing_since is None or stop.is_set():
                continue
            try:
                await asyncio.wait_for(ask(), PROBE_TIMEOUT_S)
            except Exception as error:  # noqa: BLE001 - a probe never ends the worker
                self.failed("consumer info", error)
            else:
                self.answered()
