"""Making job consumers within a bound well under the server's per-stream consumer limit.

The bound: ``WORKER_NATS__MAX_JOB_CONSUMERS``, and at most half of the server's per-stream
limit (the stream's ``max_consumers``, else the account's, else 1,000 as nats-server 2.15's
default), counted from the consumer listing of each discovery. Processes count alike, so a
fleet overshoots it by at most what its processes make in one discovery between them. A
consumer the server refuses is counted and logged once while the refusals last; its job waits
for room. Remakes owed (a task published as its job's consumer was deleted, no room then) are
made first at the next discovery, from where the deleted consumer stopped.
"""

from __future__ import annotations

from collections.abc import Callable

import nats
import structlog
from nats.js import JetStreamContext, api
from nats.js.errors import APIError, NotFoundError

from worker.nats.job_state import JobConsumerState

log = structlog.get_logger(__name__)
ASSUMED_SERVER_LIMIT = 1000  # nats-server 2.15's per-stream default, where nothing says more


class ConsumerMaker:
    """Makes job consumers (or finds them made elsewhere) while the state says there is
    room, and tells it what the server answered: on the tasks ``stream``, each job subject's
    consumer as ``config_of`` makes it, ``most`` at once (``WORKER_NATS__MAX_JOB_CONSUMERS``)
    or fewer where the server allows fewer."""

    def __init__(
        self,
        js: JetStreamContext,
        state: JobConsumerState,
        *,
        stream: str,
        config_of: Callable[[str], api.ConsumerConfig],
        most: int,
    ):
        self._js = js
        self._state = state
        self._stream = stream
        self._config_of = config_of
        self._most = most

    async def open(self) -> None:
        limit = await self._server_limit()
        self._state.bounded(max(1, min(self._most, limit // 2)))
        log.info("job_consumers_bounded", most_at_once=self._state.bound)

    async def _server_limit(self) -> int:
        """The stream's max_consumers, else the account's, else the assumed default."""
        info = await self._js.stream_info(self._stream)
        if info.config.max_consumers and info.config.max_consumers > 0:
            return int(info.config.max_consumers)
        try:
            account = await self._js.account_info()
        except (nats.errors.Error, TimeoutError):
            return ASSUMED_SERVER_LIMIT
        limit = account.limits.max_consumers
        return int(limit) if limit and limit > 0 else ASSUMED_SERVER_LIMIT

    async def make_owed(self) -> None:
        """The remakes owed, each done while there is room."""
        for subject, start in self._state.owed():
            if await self.make(subject, start=start):
                self._state.paid(subject)

    async def make(self, subject: str, start: int = 0) -> bool:
        """Make ``subject``'s consumer (from stream sequence ``start`` when given); False when
        there is no room for more now (the bound, or the server's refusal)."""
        if not self._state.room():
            return False
        config = self._config_of(subject)
        if start:
            config.deliver_policy = api.DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = start
        try:
            info = await self._js.add_consumer(self._stream, config)
        except APIError as error:
            try:  # made meanwhile by another worker (with another start): that one serves
                self._state.found(await self._js.consumer_info(self._stream, config.name or ""))
                return True
            except NotFoundError:
                self._refused(subject, error)
                return False
        if self._state.made(info):  # else add_consumer found it made: nothing new
            log.info("job_consumer_made", consumer=info.name, subject=subject, start_seq=start or 1)
        return True

    def _refused(self, subject: str, error: APIError) -> None:
        """Counted each time; logged once while the refusals last (they are retried at every
        discovery)."""
        first = self._state.refused(
            f"NATS refused a job consumer on stream {self._stream}: "
            f"{error.description or error} (code {error.err_code}); new jobs wait for room"
        )
        (log.error if first else log.debug)(
            "job_consumer_refused",
            subject=subject,
            error=f"{error.description or error} (code {error.err_code})",
            hint="the stream's or account's max_consumers is reached (other clients' "
            "consumers count too): jobs wait until there is room",
        )
