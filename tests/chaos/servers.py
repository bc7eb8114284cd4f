"""Chaos fixtures: a three-node JetStream cluster, and an S3 proxy that fails on request."""

from __future__ import annotations

import http.client
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from worker.commands.localservers import find_nats_server, free_port, stop_process, wait_port


class NatsCluster:
    """Three nats-server processes routed into one JetStream cluster on 127.0.0.1."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="iw-cluster-"))
        self.ports = [free_port() for _ in range(3)]
        self.routes = [free_port() for _ in range(3)]
        self.procs: list[subprocess.Popen[bytes] | None] = [None, None, None]
        self.frozen: set[int] = set()

    @property
    def url(self) -> str:
        return self.urls()

    def urls(self, *nodes: int) -> str:
        """The client URLs of ``nodes`` (all three when none are named)."""
        return ",".join(f"nats://127.0.0.1:{self.ports[i]}" for i in nodes or range(3))

    def _conf(self, i: int) -> Path:
        routes = ", ".join(
            f"nats-route://127.0.0.1:{p}" for j, p in enumerate(self.routes) if j != i
        )
        conf = self.dir / f"n{i}.conf"
        conf.write_text(
            f"server_name: n{i}\nlisten: 127.0.0.1:{self.ports[i]}\n"
            f"jetstream {{ store_dir: {self.dir / f'store{i}'} }}\n"
            f"cluster {{ name: chaos, listen: 127.0.0.1:{self.routes[i]}, routes: [{routes}] }}\n"
        )
        return conf

    def start_node(self, i: int) -> None:
        log = open(self.dir / f"n{i}.log", "ab")  # noqa: SIM115 - closed with the process
        self.procs[i] = subprocess.Popen(
            [find_nats_server(), "-c", str(self._conf(i))],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
        )
        wait_port(self.ports[i], self.procs[i], f"nats-server n{i}")

    def start(self) -> NatsCluster:
        for i in range(3):
            self.start_node(i)
        return self

    def kill_node(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None:
            proc.kill()
            proc.wait(timeout=10)
            self.procs[i] = None

    def freeze_node(self, i: int) -> int:
        """SIGSTOP node ``i``: a hung server (or a paused VM): its sockets stay open, and
        nothing answers. ``stop`` thaws it; returns its pid."""
        proc = self.procs[i]
        assert proc is not None, f"node n{i} is not running"
        proc.send_signal(signal.SIGSTOP)
        self.frozen.add(i)
        return proc.pid

    def thaw_node(self, i: int) -> None:
        proc = self.procs[i]
        if i in self.frozen and proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
        self.frozen.discard(i)

    def stop(self) -> None:
        for i in list(self.frozen):
            self.thaw_node(i)  # a stopped process would not act on its SIGTERM
        for i in range(3):
            proc = self.procs[i]
            if proc is not None:
                stop_process(proc)
                self.procs[i] = None
        shutil.rmtree(self.dir, ignore_errors=True)


class _QuietOnHangUp(ThreadingHTTPServer):
    """A client that hangs up mid-answer (a worker or loader child killed by the scenario) is
    the fault under test, not an error of the proxy: no traceback for it on stderr."""

    def handle_error(self, request: object, client_address: object) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)  # type: ignore[arg-type]


class FlakyS3Proxy:
    """Forwards to a real S3 endpoint, each request ``delay_s`` late (a job then lasts long
    enough for a fault to land in its middle); ``fail_for(seconds)`` answers 503/500 until
    it ends."""

    def __init__(self, upstream_port: int, delay_s: float = 0.0) -> None:
        self.upstream_port = upstream_port
        self.delay_s = delay_s
        self._lock = threading.Lock()
        self._fail_until = 0.0
        self._statuses: tuple[int, ...] = (503, 500)
        self.failed = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                time.sleep(proxy.delay_s)  # latency of the link, not an ordering of the test
                status = proxy._take_failure()
                if status is not None:
                    payload = b"<Error><Code>ServiceUnavailable</Code></Error>"
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=30)
                try:
                    upstream.request(self.command, self.path, body=body, headers=dict(self.headers))
                    response = upstream.getresponse()
                    data = response.read()
                finally:
                    upstream.close()
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

            def log_message(self, format: str, *args: object) -> None:
                return

        self.port = free_port()
        self._server = _QuietOnHangUp(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _take_failure(self) -> int | None:
        with self._lock:
            if time.monotonic() < self._fail_until:
                self.failed += 1
                return self._statuses[self.failed % len(self._statuses)]
        return None

    def fail_for(self, seconds: float, statuses: tuple[int, ...] = (503, 500)) -> None:
        with self._lock:
            self._statuses = statuses
            self._fail_until = time.monotonic() + seconds

    def start(self) -> FlakyS3Proxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
