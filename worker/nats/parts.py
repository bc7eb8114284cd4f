"""The NATS source's parts, built once from the settings (the counterpart of
``worker/antenna/parts.py``): the connection, the provisioned streams and consumers, the
feed, the results stream, the dead letters, the settler, the max-deliveries handler,
and their shutdown. Each part is given what it uses of the NATS settings (keyword arguments,
or the names in ``worker.nats.subjects.ConsumerNames``); the group itself is read only here
and by the parts that use most of it (the connection and its auth, provisioning, the feed, the
job consumers: ``tests/unit/nats/test_parts.py`` holds that list)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
from nats.aio.client import Client as NATS

from config.derived import unconfigured_source
from config.redact import redact_url
from config.settings import NatsSettings, Settings
from worker.core.link import SourceLink
from worker.core.ports import SourceHealth
from worker.core.results import ResultMaker
from worker.core.verdicts import Backoff
from worker.engine.served import ServedPipelines
from worker.health.metrics import Metrics
from worker.health.tasks_waiting import TasksWaiting
from worker.nats.advisories import ExhaustedTasks
from worker.nats.algorithms import publish_algorithms
from worker.nats.connection import ConnectionState, abort_socket, connect
from worker.nats.dead_letters import DeadLetters
from worker.nats.delivery import NatsHandle
from worker.nats.feed import TaskFeed
from worker.nats.jetstream_health import JetStreamAnswers
from worker.nats.patience import UntilConnected, at_once
from worker.nats.provision import consumer_names, provision, refuse_other_fair_jobs
from worker.nats.result_store import ResultStore
from worker.nats.settle import NatsSettler
from worker.nats.source import NatsSource
from worker.nats.source_metrics import JobConsumersCollector
from worker.nats.subjects import ConsumerNames
from worker.nats.waiting import nats_waiting_read

log = structlog.get_logger(__name__)
_CLOSE_WAIT_S = 10.0


def result_store(
    js: Any,
    n: NatsSettings,
    max_payload: Callable[[], int] = lambda: 1024 * 1024,
    answers: JetStreamAnswers | None = None,
    *,
    slow_store_s: float = 0.0,
) -> ResultStore:
    """The results stream the settings name, or one made slower when a chaos test asks
    (WORKER_FAULTS__SLOW_STORE_S, ``slow_store_s``)."""
    where = {"stream": n.results_stream, "objects": n.result_objects}
    if not slow_store_s:
        return ResultStore(js, max_payload, answers, **where, publish_timeout_s=n.publish_timeout_s)
    from worker.nats.faults import SlowResultStore

    return SlowResultStore(
        js,
        max_payload,
        answers,
        **where,
        publish_timeout_s=n.publish_timeout_s,
        seconds=slow_store_s,
    )


def nats_settler(
    js: Any,
    n: NatsSettings,
    store: ResultStore,
    default_pipeline: str,
    model_of: Callable[[str], dict[str, Any]] = lambda _pipeline: {},
    *,
    count: Callable[[str, str], None] = lambda _outcome, _pipeline: None,
    completed_twice: Callable[[], None] = lambda: None,
    until_connected: UntilConnected = at_once,
) -> NatsSettler:
    """The settler over the results stream ``store`` and the dead-letter stream the settings
    name; a task left for another delivery waits as ``WORKER_NATS__NAK_BACKOFF_*`` say;
    ``count``, ``completed_twice`` and ``until_connected`` as ``NatsSettler`` says."""
    dead_letters = DeadLetters(
        js,
        store.max_message_bytes,
        stream=n.dead_letter_stream,
        subject=n.dead_letter_subject,
        tasks_stream=n.tasks_stream,
        publish_timeout_s=n.publish_timeout_s,
        store_retry_s=n.store_retry_s,
    )
    return NatsSettler(
        store,
        dead_letters,
        ResultMaker(model_of),
        default_pipeline,
        n.store_retry_s,
        Backoff(n.nak_backoff_base_s, n.nak_backoff_max_s),
        count=count,
        completed_twice=completed_twice,
        until_connected=until_connected,
    )


class NatsParts:
    """``open`` connects and provisions; ``close`` takes it down, whatever ``open`` reached."""

    def __init__(
        self,
        settings: Settings,
        served: ServedPipelines,
        metrics: Metrics,
        *,
        slow_store_s: float = 0.0,  # a test hook (``config/faults.py``): 0 = off
    ) -> None:
        self._settings = settings
        self._slow_store_s = slow_store_s
        self._served = served
        self._metrics = metrics
        self.connection = ConnectionState()
        self.answers = JetStreamAnswers()  # whether JetStream answers, the connection up
        self.nc: NATS | None = None
        self.feed: TaskFeed | None = None
        self.settler: NatsSettler | None = None
        self._source: NatsSource | None = None
        self._link: SourceLink[NatsHandle] | None = None
        self.waiting: TasksWaiting | None = None

    @property
    def link(self) -> SourceLink[NatsHandle]:
        assert self._link is not None, "open() first"
        return self._link

    async def open(self) -> None:
        """Connect, provision, and build the parts over the connection, each counting into
        the metrics (the job consumers' and the tasks waiting are registered with them)."""
        s, served, metrics = self._settings, self._served, self._metrics
        unconfigured = unconfigured_source(s, Path(".env"))
        if unconfigured is not None:
            log.warning("task_source_defaulted", nats_url=redact_url(s.nats.url), why=unconfigured)
        self.nc = nc = await connect(s.nats, state=self.connection)
        js = nc.jetstream()
        await refuse_other_fair_jobs(js, s.nats)
        await provision(js, s.nats, served.names)
        self.feed = TaskFeed(nc, s.nats, served.names, self.answers)
        await self.feed.open()
        metrics.registry.register(JobConsumersCollector(self.feed.job_stats))
        store = result_store(
            js, s.nats, lambda: int(nc.max_payload), self.answers, slow_store_s=self._slow_store_s
        )
        max_deliver = await self.feed.max_deliver()
        self.settler = nats_settler(
            js,
            s.nats,
            store,
            served.default,
            served.model_info,
            count=metrics.count_task,
            completed_twice=metrics.results_already_stored.inc,
            until_connected=self.connection.until_connected,
        )
        names = consumer_names(s.nats)
        self.waiting = TasksWaiting(
            nats_waiting_read(js, names, served.names), s.metrics.tasks_waiting_read_s
        )
        metrics.registry.register(self.waiting)
        self._source = NatsSource(self.feed, max_deliver, served.default)
        self._link = self._linked(js, names, store, self.settler, self.waiting)

    def _linked(
        self,
        js: Any,
        names: ConsumerNames,
        store: ResultStore,
        settler: NatsSettler,
        waiting: TasksWaiting,
    ) -> SourceLink[NatsHandle]:
        """What the core is given of the opened parts, with the helpers that run beside it."""
        s, source = self._settings, self._source
        assert source is not None, "open() builds the source first"
        exhausted = ExhaustedTasks(js, names, settler, fetch_timeout_s=s.nats.fetch_timeout_s)
        return SourceLink(
            kind="nats",
            source=source,
            results=store,
            settler=settler,
            backoff=settler.backoff,
            model_of=self._served.model_info,
            fetch_wait_s=s.nats.fetch_timeout_s,
            keepalive_tick_s=s.nats.ack_wait_s / 4,
            gone=self.connection.lost,
            gone_reason="the NATS connection closed for good",
            unserved=self.unserved,
            helpers=(
                ("max-deliveries", exhausted.run),
                ("tasks-waiting", waiting.run),
                ("jetstream-probe", self._probe(js)),
            ),
        )

    def unserved(self) -> str | None:
        """An idle burst run that served no task from a source nobody configured ends
        NOT_SERVED, naming the settings: it is on some NATS on localhost, not its own."""
        why = unconfigured_source(self._settings, Path(".env"))
        if why is None or self._source is None or self._source.delivered:
            return None
        return f"{why}; this run served no task from NATS at {redact_url(self._settings.nats.url)}"

    def _probe(self, js: Any) -> Callable[[asyncio.Event], Any]:
        """While JetStream's requests fail, ask the tasks consumer's info (``answers``)."""
        stream, consumer = self._settings.nats.tasks_stream, self._settings.nats.consumer
        return lambda stop: self.answers.probe(lambda: js.consumer_info(stream, consumer), stop)

    def problem(self) -> str | None:
        """The connection down, JetStream not answering over it, or the feed's problem, each
        said after ``WORKER_HEALTH__DISCONNECTED_TIMEOUT_S`` (the connection's stale sooner)."""
        down_timeout_s = self._settings.health.disconnected_timeout_s
        feed = self.feed.problem() if self.feed is not None else None
        said = self.connection.problem(down_timeout_s)
        return said or self.answers.problem(down_timeout_s) or feed

    def health(self) -> SourceHealth:
        return SourceHealth(self.connection.connected(), self.connection.down_for_s())

    def started(self) -> dict[str, Any]:
        source = self._source
        return {"max_deliver": source.max_deliver if source is not None else None}

    async def loaded(self, pipeline: str) -> None:
        """Publish the loaded pipeline's algorithms (their class lists) for ``results``."""
        runner = self._served.loaded(pipeline)
        if runner is not None and self.nc is not None:
            configs = [a.config() for a in runner.algorithms()]
            await publish_algorithms(self.nc.jetstream(), self._settings.nats.algorithms, configs)

    async def close(self) -> None:
        """The feed (its subscriptions), then the connection, drained; each step bounded."""
        if self.feed is not None:
            await self.feed.close()
        self.connection.closing = True
        nc = self.nc
        if nc is not None and not nc.is_closed:
            try:
                await asyncio.wait_for(nc.drain(), _CLOSE_WAIT_S)
            except Exception:  # noqa: BLE001 - closing anyway
                await _closed(nc)


async def _closed(nc: NATS) -> None:
    """Close, within ``_CLOSE_WAIT_S``: nats-py's close flushes what is pending and waits for
    the socket to close, which a server that stopped reading never lets happen (the given-back
    naks a drain gave up on are pending then); past the bound the socket is aborted."""
    try:
        await asyncio.wait_for(nc.close(), _CLOSE_WAIT_S)
    except Exception:  # noqa: BLE001 - the process is ending either way
        log.warning("nats_close_stuck", action="aborting the socket", aborted=abort_socket(nc))
