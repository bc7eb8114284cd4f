"""NATS JetStream: connect, provision streams and the durable consumer, fetch tasks.

Knows nothing of torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import nats
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError

from config.errors import TransientError
from config.redact import redact_url
from config.settings import NatsSettings

log = structlog.get_logger(__name__)
DEAD_LETTER_DEDUPE_S = 3600.0


def tasks_subject(pipeline: str) -> str:
    return f"tasks.{pipeline}"


def job_tasks_subject(pipeline: str, job_token: str) -> str:
    """Where a job's tasks go: the job in the subject, so a job's tasks can be read alone."""
    return f"tasks.{pipeline}.{job_token}"


class ConnectionState:
    """What the NATS client's callbacks said last; read by /healthz and the orchestrator.

    nats-py closes a client for good on any protocol error the server reports, whatever
    ``max_reconnect_attempts`` says; a closed client fetches nothing ever again, so it must
    end the process, not leave an idle-looking worker behind.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.disconnected_at: float | None = None
        self.closed = asyncio.Event()
        self.lost = asyncio.Event()  # closed for good, and not by us
        self.closed_reason = ""
        self.closing = False  # our own close is not a failure

    def down_for_s(self) -> float:
        """Seconds since the connection was lost (0 while connected)."""
        since = self.disconnected_at
        return 0.0 if since is None else self._clock() - since

    def unexpectedly_closed(self) -> bool:
        return self.closed.is_set() and not self.closing

    def connected(self) -> bool:
        return self.disconnected_at is None and not self.closed.is_set()

    def problem(self, down_timeout_s: float) -> str | None:
        """Why the connection makes this process unhealthy, or None."""
        if self.unexpectedly_closed():
            return "nats: the connection closed for good; the process exits for a fresh one"
        down_s = self.down_for_s()
        if down_s >= down_timeout_s:
            return f"nats: disconnected for {down_s:.0f}s (timeout {down_timeout_s:g}s)"
        return None


async def connect(
    settings: NatsSettings,
    *,
    name: str = "inference-worker",
    state: ConnectionState | None = None,
    give_up_after_s: float | None = None,
) -> NATS:
    """Connect with unlimited reconnects; the worker survives a server restart. A command that
    runs once passes ``give_up_after_s``: no first connection by then is a TransientError
    naming the server(s), and the attempts stop."""
    client, state = NATS(), state or ConnectionState()
    try:
        return await asyncio.wait_for(_connect(client, settings, name, state), give_up_after_s)
    except TimeoutError:
        if give_up_after_s is None:
            raise  # nats-py's own, not ours
        state.closing = True  # a close we asked for: not a lost connection
        with contextlib.suppress(Exception):
            await client.close()  # stops any attempt still scheduled
    servers = ", ".join(redact_url(url) for url in _servers(settings))
    raise TransientError(f"NATS at {servers} could not be reached within {give_up_after_s}s")


async def _connect(client: NATS, settings: NatsSettings, name: str, state: ConnectionState) -> NATS:

    async def on_error(error: Exception) -> None:
        log.warning("nats_error", error=str(error))
        state.closed_reason = str(error)

    async def on_disconnect() -> None:
        if state.disconnected_at is None:
            state.disconnected_at = time.monotonic()
        if not (client.is_closed or client.is_draining or state.closing):
            log.warning("nats_disconnected", hint="reconnecting; work continues when it is back")

    async def on_reconnect() -> None:
        state.disconnected_at = None
        log.info("nats_reconnected")

    async def on_closed() -> None:
        if state.disconnected_at is None:
            state.disconnected_at = time.monotonic()
        if client.last_error is None:
            state.closing = True  # no error: a close we asked for (drain, close)
        if not state.closing:
            state.lost.set()
            log.error(
                "nats_connection_closed",
                reason=str(client.last_error or state.closed_reason or "unknown"),
                action="giving back held work and exiting 5 for a fresh process",
            )
        state.closed.set()

    await client.connect(
        servers=_servers(settings),
        name=name,
        connect_timeout=5,
        reconnect_time_wait=1,
        max_reconnect_attempts=-1,
        allow_reconnect=True,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        closed_cb=on_closed,
    )
    return client


def _servers(settings: NatsSettings) -> list[str]:
    return [url.strip() for url in settings.url.split(",")]


def stream_configs(settings: NatsSettings) -> list[api.StreamConfig]:
    return [
        api.StreamConfig(
            name=settings.tasks_stream,
            subjects=["tasks.>"],
            retention=api.RetentionPolicy.LIMITS,
            storage=api.StorageType.FILE,
            max_age=settings.tasks_max_age_s,
            num_replicas=settings.replicas,
        ),
        # One message per task subject, new ones refused: at most one result per task id
        # for as long as results are kept, not only inside the deduplication window.
        api.StreamConfig(
            name=settings.results_stream,
            subjects=["results.>"],
            retention=api.RetentionPolicy.LIMITS,
            storage=api.StorageType.FILE,
            max_msgs_per_subject=1,
            discard=api.DiscardPolicy.NEW,
            discard_new_per_subject=True,
            max_age=settings.results_max_age_s,
            allow_direct=True,
            num_replicas=settings.replicas,
        ),
        api.StreamConfig(
            name=settings.dead_letter_stream,
            subjects=[settings.dead_letter_subject],
            retention=api.RetentionPolicy.LIMITS,
            storage=api.StorageType.FILE,
            max_age=settings.results_max_age_s,
            # The worker and the max-deliveries handler may both dead-letter one message
            # minutes apart; the dedupe id (its tasks-stream sequence) keeps it once.
            duplicate_window=min(DEAD_LETTER_DEDUPE_S, settings.results_max_age_s),
            num_replicas=settings.replicas,
        ),
    ]


def consumer_config(settings: NatsSettings, pipeline: str) -> api.ConsumerConfig:
    return api.ConsumerConfig(
        name=settings.consumer,
        durable_name=settings.consumer,
        # Tasks with the job in the payload, and tasks with the job in the subject (Antenna's).
        filter_subjects=[tasks_subject(pipeline), job_tasks_subject(pipeline, "*")],
        ack_policy=api.AckPolicy.EXPLICIT,
        deliver_policy=api.DeliverPolicy.ALL,
        ack_wait=settings.ack_wait_s,
        max_deliver=settings.max_deliver,
        max_ack_pending=10_000,
        max_waiting=512,
        num_replicas=settings.replicas if settings.replicas > 1 else None,
    )


def advisory_subject(settings: NatsSettings) -> str:
    return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{settings.tasks_stream}.{settings.consumer}"


def advisory_consumer(settings: NatsSettings) -> str:
    return f"{settings.consumer}-max-deliveries"


def advisory_stream_config(settings: NatsSettings) -> api.StreamConfig:
    return api.StreamConfig(
        name=settings.advisory_stream,
        subjects=[advisory_subject(settings)],
        retention=api.RetentionPolicy.LIMITS,
        storage=api.StorageType.FILE,
        max_age=settings.tasks_max_age_s,
        num_replicas=settings.replicas,
    )


def advisory_consumer_config(settings: NatsSettings) -> api.ConsumerConfig:
    name = advisory_consumer(settings)
    return api.ConsumerConfig(
        name=name,
        durable_name=name,
        ack_policy=api.AckPolicy.EXPLICIT,
        deliver_policy=api.DeliverPolicy.ALL,
        ack_wait=60.0,
        # Unlimited: an outage of the stores is waited out with backoff; a poison advisory
        # is terminated by the handler after a few attempts (advisories.POISON_ATTEMPTS).
        max_deliver=-1,
        num_replicas=settings.replicas if settings.replicas > 1 else None,
    )


async def provision(js: JetStreamContext, settings: NatsSettings, pipeline: str) -> list[str]:
    """Create or update the streams and the durable consumer; safe to run any number of times."""
    done: list[str] = []
    for config in [*stream_configs(settings), advisory_stream_config(settings)]:
        try:
            await js.stream_info(config.name)  # type: ignore[arg-type]
        except NotFoundError:
            await js.add_stream(config)
            done.append(f"created stream {config.name}")
        else:
            await js.update_stream(config)
            done.append(f"updated stream {config.name}")
    # Responses outlive their results by a day (written first, they must not expire first);
    # category maps never expire.
    for bucket, ttl_s in (
        (settings.result_objects, settings.results_max_age_s + 86400.0),
        (settings.algorithms, None),
    ):
        try:
            await js.object_store(bucket)
        except NotFoundError:
            await js.create_object_store(
                bucket,
                config=api.ObjectStoreConfig(
                    ttl=ttl_s, storage=api.StorageType.FILE, replicas=settings.replicas
                ),
            )
            done.append(f"created object store {bucket}")
    # pull_subscribe ignores the config of an existing durable; add_consumer with a name
    # creates it or updates it in place.
    await js.add_consumer(settings.tasks_stream, consumer_config(settings, pipeline))
    done.append(
        f"created or updated consumer {settings.consumer} on {tasks_subject(pipeline)} and "
        f"{job_tasks_subject(pipeline, '*')}"
    )
    watcher = advisory_consumer_config(settings)
    await js.add_consumer(settings.advisory_stream, watcher)
    done.append(f"created or updated consumer {watcher.name} on max-deliveries advisories")
    return done


class TaskFeed:
    """Bounded fetches from the durable pull consumer (the orchestrator's TaskSource)."""

    def __init__(self, nc: NATS, settings: NatsSettings) -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self._settings = settings
        self._sub: Any = None

    async def open(self) -> None:
        self._sub = await self._js.pull_subscribe_bind(
            durable=self._settings.consumer, stream=self._settings.tasks_stream
        )

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
            (self._settings.advisory_stream, advisory_consumer(self._settings)),
        ]
        try:
            for stream, consumer in consumers:
                info = await self._js.consumer_info(stream, consumer)
                if info.num_pending or info.num_ack_pending:
                    return False
        except (nats.errors.Error, TimeoutError):
            return False
        return True

    async def fetch(self, batch: int) -> list[Msg]:
        """Up to ``batch`` messages; [] after ``fetch_timeout_s`` or while disconnected."""
        try:
            msgs: list[Msg] = await self._sub.fetch(batch, timeout=self._settings.fetch_timeout_s)
            return msgs
        except (TimeoutError, nats.errors.TimeoutError):
            return []
        except (
            nats.errors.ConnectionClosedError,
            nats.errors.ConnectionReconnectingError,
            nats.errors.NoRespondersError,
            nats.js.errors.ServiceUnavailableError,
        ) as error:
            log.warning("fetch_failed_will_retry", error=type(error).__name__)
            await asyncio.sleep(self._settings.fetch_timeout_s)
            return []

    async def close(self) -> list[Msg]:
        """Stop fetching for good; return messages delivered after the last fetch gave up.

        The subscription goes first, so the server drops our open pull requests: tasks given
        back afterwards are redelivered to other workers, not straight back to us.
        """
        if self._sub is None:
            return []
        pending = late_deliveries(self._sub)
        try:
            await self._sub.unsubscribe()
            await self._nc.flush(timeout=5)
        except (nats.errors.Error, TimeoutError):
            pass
        self._sub = None
        found: list[Msg] = []
        while pending is not None and not pending.empty():
            msg = pending.get_nowait()
            if not JetStreamContext.is_status_msg(msg):
                found.append(msg)
        return found


def late_deliveries(sub: Any) -> asyncio.Queue[Msg] | None:
    """The queue where nats-py keeps messages delivered to a pull subscription after its
    last fetch returned (``PullSubscription._sub._pending_queue``, nats-py 2.x; the one
    private attribute of nats-py we read, tested in ``tests/unit/test_transport.py``).

    If it has moved, None: those messages are then not given back at once but wait out
    their ack wait, which costs time, never a task.
    """
    queue = getattr(getattr(sub, "_sub", None), "_pending_queue", None)
    if isinstance(queue, asyncio.Queue):
        return queue
    log.warning(
        "nats_internals_moved",
        hint="late deliveries are left to their ack wait; check the nats-py version",
    )
    return None
