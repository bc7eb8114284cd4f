"""The /metrics + /healthz HTTP server: bounded connections, each with a deadline."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

MAX_CONNECTIONS = 16  # /metrics and /healthz served at once; more are refused
READ_TIMEOUT_S = 5.0
CONNECTION_DEADLINE_S = 10.0

log = structlog.get_logger(__name__)


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
    ) -> None:
        self._slots = threading.BoundedSemaphore(max_connections)
        self._deadline_s = connection_deadline_s
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # over the bound: refused, nothing kept
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        cutoff = threading.Timer(self._deadline_s, _cut, args=(request,))
        cutoff.daemon = True
        cutoff.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            cutoff.cancel()
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.warning("metrics_request_failed", exc_info=True)


def _cut(sock: socket.socket) -> None:
    """End a connection past its deadline: blocked reads and writes return at once."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class HealthServer:
    """GET /metrics and GET /healthz on a daemon thread; port 0 turns it off.

    ``unhealthy`` says why the process is unhealthy (``stalled: ...``, ``nats: ...``), or None.
    """

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        unhealthy: Callable[[], str | None],
        max_connections: int = MAX_CONNECTIONS,
        connection_deadline_s: float = CONNECTION_DEADLINE_S,
    ) -> None:
        class Handler(BaseHTTPRequestHandler):
            timeout = READ_TIMEOUT_S  # per read; the server's cutoff bounds the whole exchange

            def do_GET(self) -> None:
                if self.path.startswith("/metrics"):
                    self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                elif self.path.startswith("/healthz"):
                    reason = unhealthy()
                    if reason is None:
                        self._send(200, b"ok\n", "text/plain")
                    else:
                        self._send(503, f"{reason}\n".encode(), "text/plain")
                else:
                    self._send(404, b"not found; try /metrics or /healthz\n", "text/plain")

            def _send(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                return  # scrapes every few seconds are not news

        self._server = _BoundedHTTPServer(
            (host, port), Handler, max_connections, connection_deadline_s
        )
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="health-http", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
