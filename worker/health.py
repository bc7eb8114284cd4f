"""Liveness state, Prometheus metrics in one injected registry, the /metrics + /healthz server."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from datasets.reads import ReadStats
from worker.ports import BatchReport
from worker.watchdog import Watchdog

PREFIX = "inference_worker"
MAX_CONNECTIONS = 16  # /metrics and /healthz served at once; more are refused
READ_TIMEOUT_S = 5.0
CONNECTION_DEADLINE_S = 10.0

log = structlog.get_logger(__name__)


class Liveness:
    """The stall rule: stalled while tasks are held and no batch completed for stall_timeout_s.

    An idle worker is never stalled: while nothing is held, "last progress" keeps moving.
    """

    def __init__(
        self,
        stall_timeout_s: float,
        clock: Callable[[], float] = time.time,
        watchdog: Watchdog | None = None,
    ) -> None:
        self.stall_timeout_s = stall_timeout_s
        self._clock = clock
        self._watchdog = watchdog
        self._lock = threading.Lock()
        self._held = 0
        self._last_progress = clock()

    def set_held(self, held: int) -> None:
        with self._lock:
            if self._held == 0 or held == 0:
                # Work taken on by an idle worker, or the last of it settled: the clock starts now.
                self._last_progress = self._clock()
                if self._watchdog is not None and held:
                    self._watchdog.arm()  # armed only while work is held
                elif self._watchdog is not None:
                    self._watchdog.disarm()  # an idle worker is never killed
            self._held = held

    def batch_completed(self) -> None:
        with self._lock:
            self._last_progress = self._clock()
            self._rearm_locked()

    def still_working(self) -> None:
        """The worker is acting (e.g. rebuilding its loader) without completing a batch: give
        the watchdog a fresh window, but leave the stall clock alone."""
        with self._lock:
            self._rearm_locked()

    def _rearm_locked(self) -> None:
        """A fresh watchdog window, while work is held (the watchdog is disarmed otherwise)."""
        if self._watchdog is not None and self._held:
            self._watchdog.arm()

    @property
    def held(self) -> int:
        return self._held

    def last_progress(self) -> float:
        with self._lock:
            return self._clock() if self._held == 0 else self._last_progress

    def stalled_reason(self) -> str | None:
        with self._lock:
            if self._held == 0:
                return None
            idle_s = self._clock() - self._last_progress
            if idle_s < self.stall_timeout_s:
                return None
            return (
                f"{self._held} tasks held and no batch completed for {idle_s:.0f}s "
                f"(stall timeout {self.stall_timeout_s:g}s)"
            )


class Metrics:
    """Every metric of the worker, registered in the registry it is given."""

    def __init__(
        self,
        registry: CollectorRegistry,
        liveness: Liveness,
        nats_connected: Callable[[], bool] = lambda: True,
    ) -> None:
        self.registry = registry
        Gauge(
            f"{PREFIX}_nats_connected",
            "1 while the NATS connection is up; 0 while reconnecting or closed.",
            registry=registry,
        ).set_function(lambda: 1.0 if nats_connected() else 0.0)
        Gauge(
            f"{PREFIX}_last_progress_timestamp_seconds",
            "Unix time of the last completed batch, or of the last moment no work was held.",
            registry=registry,
        ).set_function(liveness.last_progress)
        Gauge(
            f"{PREFIX}_inflight_tasks",
            "Tasks held: fetched, not yet acked or naked.",
            registry=registry,
        ).set_function(lambda: liveness.held)
        Gauge(
            f"{PREFIX}_stalled",
            "1 while tasks are held and no batch has completed for the stall timeout.",
            registry=registry,
        ).set_function(lambda: 1.0 if liveness.stalled_reason() else 0.0)
        self.tasks = Counter(
            f"{PREFIX}_tasks",
            "Tasks settled, by outcome (ok, error, retried, dead_lettered).",
            ["outcome"],
            registry=registry,
        )
        for outcome in ("ok", "error", "retried", "dead_lettered"):
            self.tasks.labels(outcome)
        self.images = Counter(
            f"{PREFIX}_images", "Images run through the model.", registry=registry
        )
        self.batches = Counter(f"{PREFIX}_batches", "Batches completed.", registry=registry)
        self.batch_seconds = Histogram(
            f"{PREFIX}_batch_duration_seconds",
            "Time per batch, by stage (load, infer, store).",
            ["stage"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=registry,
        )
        for stage in ("load", "infer", "store"):  # every series there from the start
            self.batch_seconds.labels(stage)
        self.loader_restarts = Counter(
            f"{PREFIX}_loader_restarts",
            "DataLoader rebuilds after a timeout or a dead loader child.",
            registry=registry,
        )


class DeviceCollector:
    """Device memory of this process (allocated, reserved, peak) and the batches split for lack
    of it. ``memory`` returns nothing off CUDA, and then no memory series is exported."""

    def __init__(
        self, memory: Callable[[], dict[str, float]], out_of_memory: Callable[[], int]
    ) -> None:
        self._memory = memory
        self._out_of_memory = out_of_memory

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        values = self._memory()
        if values:
            family = GaugeMetricFamily(
                f"{PREFIX}_device_memory_bytes",
                "CUDA memory of this process: allocated, reserved (the caching allocator's), "
                "peak allocated.",
                labels=["kind"],
            )
            for kind, value in values.items():
                family.add_metric([kind], value)
            yield family
        yield CounterMetricFamily(
            f"{PREFIX}_out_of_memory_splits",
            "Batches halved after running out of device memory.",
            value=float(self._out_of_memory()),
        )


class ReadsCollector:
    """The loader children's object reads: in flight, the encoded bytes they hold, and the
    retries made (stalled, throttled, unavailable)."""

    def __init__(
        self, reads: Callable[[], list[ReadStats]], retries: Callable[[], dict[str, int]]
    ) -> None:
        self._reads = reads
        self._retries = retries

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        reads = self._reads()
        yield GaugeMetricFamily(
            f"{PREFIX}_loader_reads_in_flight",
            "Object reads the loader children hold (reading, or read and waiting to be "
            "decoded), as each child last reported.",
            value=float(sum(r.in_flight for r in reads)),
        )
        held = GaugeMetricFamily(
            f"{PREFIX}_loader_read_bytes",
            "Encoded bytes the loader children hold for their reads: now (held) and the most "
            "at once since each child started (peak), summed over children.",
            labels=["kind"],
        )
        held.add_metric(["held"], float(sum(r.held_bytes for r in reads)))
        held.add_metric(["peak"], float(sum(r.peak_bytes for r in reads)))
        yield held
        retries = CounterMetricFamily(
            f"{PREFIX}_source_retries",
            "Object reads made again: stalled (no byte for WORKER_S3__READ_TIMEOUT_S, retried "
            "on a new connection), throttled (429, 503 SlowDown: after a backoff), unavailable.",
            labels=["reason"],
        )
        counts = self._retries()
        for reason in ("stalled", "throttled", "unavailable"):
            retries.add_metric([reason], float(counts.get(reason, 0)))
        yield retries


class BatchObserver:
    """After each batch: progress for liveness, metrics, the batch's log line, and the
    resource guards, which ask for a fresh process through ``on_limit``."""

    def __init__(
        self,
        metrics: Metrics,
        liveness: Liveness,
        guard: Callable[[], str | None] = lambda: None,
        on_limit: Callable[[str], None] = lambda _reason: None,
    ) -> None:
        self._metrics = metrics
        self._liveness = liveness
        self._guard = guard
        self._on_limit = on_limit

    def batch_done(self, size: int, report: BatchReport) -> None:
        m = self._metrics
        ok = sum(1 for verdict in report.outcomes.values() if verdict.ok)
        self._liveness.batch_completed()
        m.batches.inc()
        m.images.inc(ok)
        m.batch_seconds.labels("load").observe(report.load_s)
        m.batch_seconds.labels("infer").observe(report.infer_s)
        if report.loader_restarts:
            m.loader_restarts.inc(report.loader_restarts)
        self._check_guards()
        log.info(
            "batch_done",
            size=size,
            ok=ok,
            load_s=round(report.load_s, 4),
            infer_s=round(report.infer_s, 4),
            loader_restarts=report.loader_restarts,
        )

    def _check_guards(self) -> None:
        try:
            reason = self._guard()
        except Exception:  # a guard that cannot read /proc this time must not stop the work
            log.exception("guard_check_failed", hint="checked again after the next batch")
            return
        if reason:
            self._on_limit(reason)


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
