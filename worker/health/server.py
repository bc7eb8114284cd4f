"""The /metrics and health probes' HTTP server: bounded connections, each with a deadline.

The probes, as Kubernetes' and Triton's (``/v2/health/live``, ``/ready``): ``/livez`` answers
503 only for what a restart mends, ``/readyz`` for that and for what keeps the process from
taking work (its task source's problem), ``/healthz`` as ``/readyz`` (what it always answered).
Their bodies are scrubbed (``config.redact.scrub``): an unavailable pipeline's load error may
name a presigned or tokened URL.

Two listeners: /metrics and the probes on the configured address (for Prometheus), and the
probes alone on loopback, with connection slots of their own, for healthwatch: no number of
idle connections to the first, from wherever they come, can make the second look dead. The
second makes room for a newcomer by closing its oldest connection when every slot is held, so
idle local connections, however many, cannot shut healthwatch's probe (sent at once, answered
in milliseconds) out: a newcomer is never refused there.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from config.names import env_name
from config.redact import scrub
from worker.health.metrics import PREFIX

MAX_CONNECTIONS = 16  # /metrics and the probes served at once; more are refused
HEALTHZ_CONNECTIONS = 64  # the loopback probes listener's own slots (the oldest gives way)
LOOPBACK = "127.0.0.1"
READ_TIMEOUT_S = 5.0
CONNECTION_DEADLINE_S = 10.0

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Probes:
    """Why the process is not live (only a restart mends it: ``stalled: ...``), and why it is
    not ready (that, or its task source's problem: ``nats: ...``); None: 200 ``ok``. A ready
    process's 200 says ``ready_note`` after ``ok``, when there is one (the pipelines that
    cannot be loaded here while others serve)."""

    not_live: Callable[[], str | None]
    not_ready: Callable[[], str | None]
    ready_note: Callable[[], str | None] = lambda: None

    def answer(self, path: str) -> Callable[[], str | None] | None:
        """The probe ``path`` asks for (matched by its start, as /healthz always was), or
        None when it asks for none."""
        for start, answer in (
            ("/livez", self.not_live),
            ("/readyz", self.not_ready),
            ("/healthz", self.not_ready),  # what it answered before /livez and /readyz
        ):
            if path.startswith(start):
                return answer
        return None


class _BoundedHTTPServer(ThreadingHTTPServer):
    """At most ``max_connections`` served at once, each for at most ``connection_deadline_s``.

    A connection over the bound is closed at once, so idle or half-open clients can hold
    neither threads nor descriptors; one that is too slow (a byte at a time) is cut at its
    deadline, whatever its individual reads do.
    """

    daemon_threads = True
    request_queue_size = 64

    def __init__(
        self,
        address: tuple[str, int],
        handler: type,
        max_connections: int,
        connection_deadline_s: float,
        oldest_gives_way: bool = False,
    ) -> None:
        self._max = max_connections
        self._held: dict[int, socket.socket] = {}  # in the order they came
        self._lock = threading.Lock()
        self._deadline_s = connection_deadline_s
        self._oldest_gives_way = oldest_gives_way
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._hold(request):
            self.shutdown_request(request)  # over the bound: refused, nothing kept
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self._let_go(request)
            raise

    def _hold(self, request: socket.socket) -> bool:
        """A slot for ``request``: a free one, or the oldest's when that one gives way."""
        with self._lock:
            if len(self._held) >= self._max:
                if not self._oldest_gives_way:
                    return False
                _cut(self._held.pop(next(iter(self._held))))  # its thread ends at once
            self._held[id(request)] = request
            return True

    def _let_go(self, request: socket.socket) -> None:
        with self._lock:
            if self._held.get(id(request)) is request:
                del self._held[id(request)]

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        cutoff = threading.Timer(self._deadline_s, _cut, args=(request,))
        cutoff.daemon = True
        cutoff.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            cutoff.cancel()
            self._let_go(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.warning("metrics_request_failed", exc_info=True)


def _cut(sock: socket.socket) -> None:
    """End a connection past its deadline: blocked reads and writes return at once."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _listen(
    address: tuple[str, int],
    handler: type,
    slots: int,
    deadline_s: float,
    oldest_gives_way: bool = False,
) -> _BoundedHTTPServer:
    """A bound, listening server; OSError naming the address when it cannot be had."""
    try:
        return _BoundedHTTPServer(address, handler, slots, deadline_s, oldest_gives_way)
    except OSError as error:
        why = f"cannot listen on {address[0]}:{address[1]}: {error.strerror or error}"
        raise OSError(error.errno, why) from None


def _scrubbed(text: str | None) -> str | None:
    """A probe's body as logs and results are written: no credential, no URL query."""
    return None if text is None else scrub(text)


def _handler(
    registry: CollectorRegistry,
    probes: Probes,
    metrics: bool,
    answered: Callable[[], None],
) -> type[BaseHTTPRequestHandler]:
    """GET /livez, /readyz and /healthz (``answered`` counts each), and GET /metrics when
    ``metrics``."""
    paths = "/livez, /readyz or /healthz"
    hint = f"not found; try {'/metrics, ' if metrics else ''}{paths}\n".encode()

    class Handler(BaseHTTPRequestHandler):
        timeout = READ_TIMEOUT_S  # per read; the server's cutoff bounds the whole exchange

        def do_GET(self) -> None:
            probe = probes.answer(self.path)
            if metrics and self.path.startswith("/metrics"):
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif probe is not None:
                answered()
                reason = _scrubbed(probe())  # a load error may name a presigned URL
                note = _scrubbed(probes.ready_note() if probe is probes.not_ready else None)
                if reason is None:
                    self._send(200, f"ok{f': {note}' if note else ''}\n".encode(), "text/plain")
                else:
                    self._send(503, f"{reason}\n".encode(), "text/plain")
            else:
                self._send(404, hint, "text/plain")

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            return  # scrapes every few seconds are not news

    return Handler


class HealthServer:
    """GET /metrics and the probes (/livez, /readyz, /healthz) on ``host:port``, and, when
    ``healthz_port`` is given, the probes alone on loopback at that port (0: any free one);
    each on a daemon thread.

    Both sockets are bound (and listening) when the constructor returns; an address that
    cannot be had raises OSError there. ``probes`` says what each probe answers.
    """

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        probes: Probes,
        max_connections: int = MAX_CONNECTIONS,
        connection_deadline_s: float = CONNECTION_DEADLINE_S,
        healthz_port: int | None = None,
    ) -> None:
        answered = Counter(
            f"{PREFIX}_healthz_requests",
            "GET /livez, /readyz or /healthz answered, by listener: metrics "
            f"({env_name('metrics', 'host')}) or healthwatch (loopback).",
            ["listener"],
            registry=registry,
        )
        self._servers = [
            _listen(
                (host, port),
                _handler(registry, probes, True, answered.labels("metrics").inc),
                max_connections,
                connection_deadline_s,
            )
        ]
        if healthz_port is not None:
            try:
                self._servers.append(
                    _listen(
                        (LOOPBACK, healthz_port),
                        _handler(registry, probes, False, answered.labels("healthwatch").inc),
                        HEALTHZ_CONNECTIONS,
                        connection_deadline_s,
                        oldest_gives_way=True,
                    )
                )
            except OSError:
                self._servers[0].server_close()
                raise
        self._threads = [
            threading.Thread(target=server.serve_forever, name="health-http", daemon=True)
            for server in self._servers
        ]

    @property
    def port(self) -> int:
        """The /metrics port."""
        return int(self._servers[0].server_address[1])

    @property
    def healthz_port(self) -> int | None:
        """The loopback probes' port, if there is that listener."""
        return int(self._servers[1].server_address[1]) if len(self._servers) > 1 else None

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def close(self) -> None:
        for server, thread in zip(self._servers, self._threads, strict=True):
            if thread.is_alive():
                server.shutdown()
            server.server_close()
            thread.join(timeout=5)
