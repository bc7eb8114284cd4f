"""Connecting to NATS, and what the client's callbacks said last. Knows nothing of torch."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog
from nats.aio.client import Client as NATS

from config.errors import TransientError
from config.redact import redact_url
from config.settings import NatsSettings
from worker.nats.auth import connect_options, refusal

if TYPE_CHECKING:
    from nats.aio.client import Server  # nats-py 2.14 and later: _NextServer's argument

log = structlog.get_logger(__name__)
# An error reported this close before a disconnect explains it (nats-py reports the server's
# close as an error, then disconnects, in one go); a disconnect with none is a stale one.
_EXPLAINED_WITHIN_S = 1.0
_CONNECT_TIMEOUT_S = 5  # one attempt at a server: TCP, its INFO, TLS
_RECONNECT_WAIT_S = 1
# A stale connection is said once the client has had time to try a server that does not
# answer (it may pick the silent one first) and go on to the next.
_STALE_GRACE_S = _CONNECT_TIMEOUT_S + _RECONNECT_WAIT_S
_STUCK_CLOSE_S = 2.0  # a reconnect's wait for the old socket to close, before it is aborted
_GUARD_TICK_S = 0.5
_WHY_STALE = "stale: no answer to pings, or the connection reset"


class ConnectionState:
    """What the NATS client's callbacks said last; read by /healthz and the orchestrator.

    nats-py closes a client for good on any protocol error the server reports, whatever
    ``max_reconnect_attempts`` says; a closed client fetches nothing ever again, so it must
    end the process, not leave an idle-looking worker behind.

    A connection that stops answering with its socket open (a hung server, a paused VM, a
    half-open path behind a NAT) is found by the client's pings (``WORKER_NATS__PING_INTERVAL_S``,
    ``WORKER_NATS__MAX_OUTSTANDING_PINGS``): nats-py drops it as stale and tries the other
    servers it knows. nats-py reports that disconnect with no error before it, where a server
    that closes the connection (a restart) is reported as an error first; ``stale`` says which.
    A connection reset while reading is reported with no error too, and counts as stale: the
    reconnect after one usually takes milliseconds, and the answer goes with it.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.disconnected_at: float | None = None
        self.stale = False  # the last disconnect came with no error: the server went silent
        self.server = ""  # the server connected to last (redacted)
        self.error_at: float | None = None  # when the client last reported an error
        self.up = asyncio.Event()  # connected now
        self.guard: asyncio.Task[None] | None = None  # _unstick_reconnects, while not closed
        self.closed = asyncio.Event()
        self.lost = asyncio.Event()  # closed for good, and not by us
        self.closed_reason = ""
        self.closing = False  # our own close is not a failure
        self.refused = asyncio.Event()  # the server refused our credentials (said why last)
        self.refused_reason = ""

    def down_for_s(self) -> float:
        """Seconds since the connection was lost (0 while connected)."""
        since = self.disconnected_at
        return 0.0 if since is None else self._clock() - since

    def unexpectedly_closed(self) -> bool:
        return self.closed.is_set() and not self.closing

    def connected(self) -> bool:
        return self.disconnected_at is None and not self.closed.is_set()

    def errored(self) -> None:
        self.error_at = self._clock()

    def went_down(self, ours: bool = False) -> None:
        """The client disconnected: stale unless it reported an error just before, or the
        close is ``ours`` (a drain or close we asked for)."""
        now = self._clock()
        if self.disconnected_at is None:
            self.disconnected_at = now
            explained = self.error_at is not None and now - self.error_at <= _EXPLAINED_WITHIN_S
            self.stale = not (ours or explained)
        self.up.clear()

    def came_up(self, server: str) -> None:
        self.server = server
        self.disconnected_at = None
        self.stale = False
        self.up.set()

    async def until_connected(self, timeout_s: float) -> None:
        """Return once connected (at once if it is), or after ``timeout_s``."""
        if self.connected() or timeout_s <= 0:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.up.wait(), timeout_s)

    def problem(self, down_timeout_s: float) -> str | None:
        """Why the connection makes this process unhealthy, or None.

        A disconnect the server announced (it closed the connection: a restart, a rolling
        upgrade) is said only after ``down_timeout_s``: such a server is usually back within
        seconds. A stale connection is said after ``_STALE_GRACE_S`` (6 s), the time the client
        needs to try one server that does not answer and go on to the next: by the time its
        pings went unanswered the server had been silent for ``MAX_OUTSTANDING_PINGS`` ping
        intervals already (the grace a restart gets is spent), a hung server or a broken path
        seldom mends itself in a restart's seconds, and until a server answers the worker can
        neither fetch nor store. Where the client knows another server (a cluster) it is
        reconnected within the grace and nothing is said (no probe counts a strike against a
        worker about to serve again); on a single server the answer stays until it answers.
        """
        if self.unexpectedly_closed():
            return "nats: the connection closed for good; the process exits for a fresh one"
        down_s = self.down_for_s()
        if self.stale and down_s >= _STALE_GRACE_S:
            return (
                "nats: the connection went stale (its server stopped answering pings, or the "
                "connection reset) and no "
                f"server has answered in the {down_s:.0f}s since; reconnecting"
            )
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
    if give_up_after_s is None:
        return await _connect(client, settings, name, state)
    attempt = asyncio.ensure_future(_connect(client, settings, name, state))
    refused = asyncio.ensure_future(state.refused.wait())
    try:
        await asyncio.wait(
            {attempt, refused}, timeout=give_up_after_s, return_when=asyncio.FIRST_COMPLETED
        )
    except asyncio.CancelledError:  # stopped while connecting: no attempt left behind
        attempt.cancel()
        raise
    finally:
        refused.cancel()
    if attempt.done() and attempt.exception() is None:
        return attempt.result()
    attempt.cancel()
    state.closing = True  # a close we asked for: not a lost connection
    with contextlib.suppress(Exception):
        await client.close()  # stops any attempt still scheduled
    servers = ", ".join(redact_url(url) for url in _servers(settings))
    if state.refused_reason:  # the server answered, and said no: waiting longer won't help
        raise TransientError(f"{state.refused_reason} at {servers}")
    if attempt.done() and not attempt.cancelled() and attempt.exception() is not None:
        raise attempt.exception()  # type: ignore[misc]
    raise TransientError(f"NATS at {servers} could not be reached within {give_up_after_s}s")


async def _connect(client: NATS, settings: NatsSettings, name: str, state: ConnectionState) -> NATS:
    await client.connect(
        servers=_servers(settings),
        name=name,
        connect_timeout=_CONNECT_TIMEOUT_S,
        reconnect_time_wait=_RECONNECT_WAIT_S,
        # nats-py's own default (120 s, 2 outstanding) finds a silent server after 4-6 min.
        ping_interval=settings.ping_interval_s,  # type: ignore[arg-type]
        max_outstanding_pings=settings.max_outstanding_pings,
        max_reconnect_attempts=-1,
        allow_reconnect=True,
        **_reconnect_order(state),
        **_callbacks(client, settings, state),
        **connect_options(settings),
    )
    state.came_up(_server_of(client))
    state.guard = asyncio.get_running_loop().create_task(_unstick_reconnects(client, state))
    return client


async def _unstick_reconnects(client: NATS, state: ConnectionState) -> None:
    """Abort the old socket of a reconnect that waits for it to close, until the client closes.

    nats-py starts a reconnect (a stale connection, a read error) by closing the old socket and
    waiting until it is closed. A socket with bytes still to send to a peer that stopped reading
    (a frozen server, a half-open path: what made the pings go unanswered) closes only once
    TCP gives up, many minutes later; meanwhile nothing is said (no disconnect callback), no
    other server is tried and, once its buffer is full, every publish and nak waits. After
    ``_STUCK_CLOSE_S`` of that the socket is aborted (its unsent bytes dropped: what they carried
    is published again or comes back by redelivery), the disconnect is said, and the reconnect
    goes on to the next server. Looked at every ``_GUARD_TICK_S``.
    """
    stuck_since: float | None = None
    while not state.closed.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(state.closed.wait(), _GUARD_TICK_S)
        if not (client.is_reconnecting and state.connected()):
            stuck_since = None  # connected, or the reconnect said its disconnect: not stuck
            continue
        now = time.monotonic()
        stuck_since = stuck_since or now
        if now - stuck_since >= _STUCK_CLOSE_S:
            stuck_since = None
            state.went_down()  # no error before it: said as stale at once (gauge, /readyz)
            log.warning(
                "nats_socket_aborted",
                server=state.server,
                reason=f"the old connection did not close within {_STUCK_CLOSE_S:g}s "
                "(unsent bytes, its server not reading)",
                aborted=abort_socket(client),
            )


def abort_socket(client: NATS) -> bool:
    """Drop the client's socket now, unsent bytes and all (asyncio's ``abort``), so nats-py's
    wait for it to close ends. nats-py has no public call for it: this reads its TCP
    transport's writers (nats-py 2.x, plain and TLS); where they are not found (another
    transport, another version) nothing is done, and False says so in the log line."""
    transport = getattr(client, "_transport", None)
    aborted = False
    for name in ("_io_writer", "_bare_io_writer"):
        writer = getattr(transport, name, None)
        raw = getattr(writer, "transport", None)
        if raw is not None and hasattr(raw, "abort"):
            raw.abort()
            aborted = True
    return aborted


def _callbacks(client: NATS, settings: NatsSettings, state: ConnectionState) -> dict[str, Any]:
    """nats-py's callbacks, each telling ``state`` and the log what happened."""

    async def on_error(error: Exception) -> None:
        state.errored()
        refused = refusal(settings, error)  # which setting's credential, never the credential
        if refused:
            log.error("nats_credentials_refused", error=refused)
            state.refused_reason = refused
            state.refused.set()
        else:
            log.warning("nats_error", error=str(error) or type(error).__name__)
        state.closed_reason = str(error)

    async def on_disconnect() -> None:
        ours = client.is_closed or client.is_draining or state.closing
        state.went_down(ours)
        if not ours:
            why = _WHY_STALE if state.stale else "closed or failed (nats_error)"
            log.warning(
                "nats_disconnected",
                server=state.server,
                reason=why,
                hint="reconnecting (to another server where one is known); work continues "
                "when it is back",
            )

    async def on_reconnect() -> None:
        state.came_up(_server_of(client))
        log.info("nats_reconnected", server=state.server)

    async def on_closed() -> None:
        state.went_down(ours=state.closing or client.last_error is None)
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

    return {
        "error_cb": on_error,
        "disconnected_cb": on_disconnect,
        "reconnected_cb": on_reconnect,
        "closed_cb": on_closed,
    }


def _reconnect_order(state: ConnectionState) -> dict[str, Any]:
    """``_NextServer`` as the reconnect handler, where nats-py takes one (a recent option:
    pyproject allows older nats-py, whose own shuffle is then kept, at up to one connect
    timeout more to leave a silent server)."""
    if "reconnect_to_server_handler" not in inspect.signature(NATS.connect).parameters:
        return {}
    return {"reconnect_to_server_handler": _NextServer(state)}


class _NextServer:
    """Which server a reconnect tries next (nats-py's ``reconnect_to_server_handler``).

    nats-py's own choice is a shuffle, so after a stale connection it may try the silent
    server first and wait out its connect timeout (5 s) before a healthy one. Here the least
    tried comes first, the one just lost last among equals; every known server is tried
    once at once, then one a second apart (nats-py's ``reconnect_time_wait``, which it does
    not apply when a handler chooses).
    """

    def __init__(self, state: ConnectionState) -> None:
        self._state = state
        self._since: float | None = None  # the disconnect this round of tries is for
        self._tried: dict[str, int] = {}  # tries of each server in this round

    def __call__(self, servers: list[Server], _info: dict[str, Any]) -> tuple[Server, float]:
        """The least tried in this round first (nats-py's ``reconnects`` counts failures since
        each server's last connection, so a server that failed in an earlier outage would lose
        its turn to the silent one for as many tries), the one just lost last among equals."""
        if self._since != self._state.disconnected_at:
            self._since, self._tried = self._state.disconnected_at, {}
        lost = self._state.server
        tries = sum(self._tried.values())

        def order(server: Server) -> tuple[int, bool, int]:
            uri = redact_url(server.uri.geturl())
            return self._tried.get(uri, 0), uri == lost, server.reconnects

        chosen = min(servers, key=order)
        uri = redact_url(chosen.uri.geturl())
        self._tried[uri] = self._tried.get(uri, 0) + 1
        return chosen, 0.0 if tries < len(servers) else float(_RECONNECT_WAIT_S)


def _server_of(client: NATS) -> str:
    url = client.connected_url
    return redact_url(url.geturl()) if url is not None else ""


def _servers(settings: NatsSettings) -> list[str]:
    return [url.strip() for url in settings.url.split(",")]
