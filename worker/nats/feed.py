"""Bounded fetches from the durable pull consumer and, for fair share, from each job's own
consumer in rotation (``worker.nats.job_consumers``): the NATS ``TaskSource``."""

from __future__ import annotations

import asyncio
from typing import Any

import nats
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from config.settings import NatsSettings
from worker.core.ports import Runnable
from worker.nats.consumer_stats import ConsumerStats
from worker.nats.hints import NewJobHints
from worker.nats.jetstream_health import JetStreamAnswers
from worker.nats.job_consumers import JobConsumers
from worker.nats.late import unsubscribe
from worker.nats.provision import consumer_names
from worker.nats.subjects import advisory_consumer

log = structlog.get_logger(__name__)


_SHARE_TIMEOUT_S = 0.2  # a job's share of a fetch: its tasks are there, or gone to another
_IDLE_PULL_S = 0.05  # an idle worker's pull on the durable consumer, once per discovery
# An idle worker woken by a new job discovers it once the hints have gone quiet for
# _HINTS_QUIET_S (at most _HINTS_SETTLE_S after the first), so jobs published together (a big
# one, then a small one) are found in one discovery and share the first fetch, and a job
# published alone waits only the quiet gap.
_HINTS_QUIET_S = 0.001
_HINTS_SETTLE_S = 0.05


class TaskFeed:
    """Bounded fetches (the orchestrator's TaskSource): from the durable pull consumer, and
    with ``fair_jobs`` from every job with pending tasks, an equal share each per fetch."""

    def __init__(
        self,
        nc: NATS,
        settings: NatsSettings,
        pipelines: list[str] | None = None,
        answers: JetStreamAnswers | None = None,
    ):
        self._nc = nc
        self._answers = answers or JetStreamAnswers()  # each fetch's outcome, for /readyz
        self._js = nc.jetstream()
        self._settings = settings
        self._names = consumer_names(settings)
        self._sub: Any = None
        self._late: list[Msg] = []
        self._jobs = (
            JobConsumers(self._js, settings, pipelines)
            if settings.fair_jobs and pipelines
            else None
        )
        self._hints = NewJobHints(nc, pipelines or [], self._jobs.hinted) if self._jobs else None
        if self._jobs is not None and self._hints is not None:
            self._jobs.hints_whole = self._hints.whole  # idle: fewer listings while heard

    async def open(self) -> None:
        self._sub = await self._js.pull_subscribe_bind(
            durable=self._settings.consumer, stream=self._settings.tasks_stream
        )
        if self._jobs is not None and self._hints is not None:
            await self._hints.open()
            self._late = await self._jobs.open()

    def problem(self) -> str | None:
        """Why this feed cannot serve new jobs now (for /healthz), or None."""
        return self._jobs.problem() if self._jobs is not None else None

    def job_stats(self) -> ConsumerStats | None:
        return self._jobs.stats if self._jobs is not None else None

    async def max_deliver(self) -> int:
        """The server's setting, which is what counts (not ours)."""
        info = await self._js.consumer_info(self._settings.tasks_stream, self._settings.consumer)
        value = info.config.max_deliver
        return int(value) if value and value > 0 else 1_000_000

    async def idle(self) -> bool:
        """Nothing pending and nothing awaiting an ack, anywhere: on the tasks consumer, and
        on the max-deliveries consumer (whose handler may still owe a task its result)."""
        consumers = [
            (self._settings.tasks_stream, self._settings.consumer),
            (self._names.advisory_stream, advisory_consumer(self._names)),
        ]
        try:
            for stream, consumer in consumers:
                info = await self._js.consumer_info(stream, consumer)
                if info.num_pending or info.num_ack_pending:
                    return False
            if self._jobs is not None and await self._jobs.busy_now():
                return False
        except (nats.errors.Error, TimeoutError):
            return False
        return True

    async def fetch(
        self, batch: int, runnable: Runnable | None = None, available: Runnable | None = None
    ) -> list[Msg]:
        """``_fetch``'s messages; any fetched puts the job discovery back at its base interval
        (``worker.nats.listing_cadence``)."""
        msgs = await self._fetch(batch, runnable, available)
        if msgs and self._jobs is not None:
            self._jobs.cadence.worked()
        return msgs

    async def _fetch(
        self, batch: int, runnable: Runnable | None = None, available: Runnable | None = None
    ) -> list[Msg]:
        """Up to ``batch`` messages; [] after ``fetch_timeout_s`` or while disconnected. With
        jobs pending, an equal share of ``batch`` from each (and from the durable consumer
        when it has tasks), the first job turning round from one fetch to the next; none from
        jobs of a pipeline ``available`` says no to."""
        if self._jobs is None:
            return await self._fetch_from(self._sub, batch, self._settings.fetch_timeout_s)
        if self._late:  # received by subscriptions since unbound: admitted first
            late, self._late = self._late[:batch], self._late[batch:]
            return late
        if self._jobs.due():
            self._late = await self._jobs.refresh()
            if self._late:
                return await self._fetch(batch, runnable, available)
        main = [self._sub] if self._jobs.main_pending and batch > 1 else []
        jobs = self._jobs.active(runnable, available)[: batch - len(main)]  # one task each
        if not jobs:
            return await self._idle_fetch(batch)
        subs = [job.sub for job in jobs] + main
        share = max(1, batch // len(subs))
        shares = [share + (i < batch - share * len(subs)) for i in range(len(subs))]
        fetched = await asyncio.gather(
            *(
                self._fetch_from(sub, n, _SHARE_TIMEOUT_S)
                for sub, n in zip(subs, shares, strict=True)
            )
        )
        for job, got, asked in zip(jobs, fetched, shares, strict=False):
            self._jobs.share_fetched(job, short=len(got) < asked)
        await self._jobs.delivered([msg for got in fetched[: len(jobs)] for msg in got])
        return [msg for got in fetched for msg in got]

    async def _idle_fetch(self, batch: int) -> list[Msg]:
        """No job bound: until the next discovery, wait for a task to be heard of
        (``NewJobHints``; [] then, once the hints go quiet, so the next fetch discovers
        its job with any published along with it), or pull
        on the durable consumer while it has tasks; else one short pull there at the end
        (a task given back on it comes back then). A new job waits for its first task's
        publish, or one discovery interval at most when it goes unheard."""
        assert self._jobs is not None
        wait_s = min(self._settings.fetch_timeout_s, self._jobs.until_due())
        if self._jobs.main_pending:
            return await self._fetch_from(self._sub, batch, max(_IDLE_PULL_S, wait_s))
        if await self._jobs.hint_within(wait_s):
            await self._jobs.settle_hints(_HINTS_QUIET_S, _HINTS_SETTLE_S)
            return []
        return await self._fetch_from(self._sub, batch, _IDLE_PULL_S)

    async def _fetch_from(self, sub: Any, batch: int, timeout_s: float) -> list[Msg]:
        try:
            msgs: list[Msg] = await sub.fetch(batch, timeout=timeout_s)
        except (TimeoutError, nats.errors.TimeoutError):
            return []  # nothing there, or nothing answered: neither clears nor starts a clock
        except (
            nats.errors.ConnectionClosedError,
            nats.errors.ConnectionReconnectingError,
            nats.errors.NoRespondersError,
            nats.js.errors.ServiceUnavailableError,
        ) as error:
            self._answers.failed("fetch", error)
            log.warning("fetch_failed_will_retry", error=type(error).__name__)
            await asyncio.sleep(self._settings.fetch_timeout_s)
            return []
        except nats.errors.Error as error:  # a job consumer deleted meanwhile: [] until unbound
            self._answers.failed("fetch", error)
            log.info("fetch_refused", error=f"{type(error).__name__}: {error}")
            return []
        if msgs:
            self._answers.answered()
        return msgs

    async def close(self) -> list[Msg]:
        """Stop fetching for good; return messages delivered after the last fetch gave up.

        The subscription goes first, so the server drops our open pull requests: tasks given
        back afterwards are redelivered to other workers, not straight back to us.
        """
        if self._sub is None:
            return []
        if self._hints is not None:
            await self._hints.close()
        jobs = await self._jobs.close() if self._jobs is not None else []
        jobs += self._late if self._jobs is not None else []
        found = await unsubscribe(self._sub, self._nc)
        self._sub = None
        return jobs + found
