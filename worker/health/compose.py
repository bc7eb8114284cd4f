"""The process's health layer, composed: the listeners (/metrics and the probes, and
healthwatch's loopback probes), the metrics in their registry, and what the probes answer.

``/livez``: 503 only for what a restart mends: ``starting`` until the worker serves, then
``restart`` once its device failed, else ``stalled``. ``/readyz``: that, else the task
source's problem (down, a refusal by its server, Antenna unreachable), which no restart mends.
``/readyz`` also names each served pipeline that cannot be loaded here and why: 503 when none
is available (the worker can take no work), 200 with their names while others serve.
``/healthz``: as ``/readyz``, what it answered before the two were apart. Whatever restarts
processes (healthwatch) asks ``/livez``; load balancers and alerts, ``/readyz``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Gauge

from config.derived import healthz_port, metrics_port
from config.errors import ConfigError
from config.names import env_name
from config.settings import Settings
from pipelines.device import memory_bytes
from pipelines.device_identity import read_identity
from pipelines.models import resolve_device
from worker.core.ports import SourceHealth
from worker.engine import Engine
from worker.engine.served import ServedPipelines
from worker.health.liveness import Liveness
from worker.health.metrics import (
    PREFIX,
    DeviceCollector,
    Metrics,
    ModelsCollector,
    ReadsCollector,
    UnavailableCollector,
)
from worker.health.procstats import ProcessTreeCollector
from worker.health.server import HealthServer, Probes

_STARTING = "starting: not serving tasks yet"


class ProcessHealth:
    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self.registry = CollectorRegistry()
        self.server: HealthServer | None = None
        self._not_live: Callable[[], str | None] = lambda: _STARTING
        self._not_ready: Callable[[], str | None] = lambda: _STARTING
        self._ready_note: Callable[[], str | None] = lambda: None

    def listen(self) -> None:
        """Bind the listeners when a port is set, answering ``starting`` (503) until
        ``serve``: first in a start, so a port another process holds ends it at once (exit 2)."""
        s = self._settings
        port = metrics_port(s)
        if not port:
            return
        try:
            self.server = HealthServer(
                s.metrics.host,
                port,
                self.registry,
                Probes(
                    lambda: self._not_live(),
                    lambda: self._not_ready(),
                    lambda: self._ready_note(),
                ),
                healthz_port=healthz_port(s),
            )
        except OSError as error:
            raise ConfigError(
                f"{env_name('metrics', 'port')}: {error.strerror or error} (another process "
                f"holds the port, or {env_name('metrics', 'host')} is not this host's address)"
            ) from None
        self.server.start()

    def metrics(
        self,
        liveness: Liveness,
        loader_pids: Callable[[], list[int]],
        source: str,
        source_health: Callable[[], SourceHealth],
        pipelines: Sequence[str] = (),
    ) -> Metrics:
        """The metrics, in the registry /metrics serves, made before the parts that count into
        them (the task source's); the probes still answer ``starting`` until ``serve``."""
        metrics = Metrics(self.registry, liveness, source, source_health, pipelines)
        self.registry.register(ProcessTreeCollector(PREFIX, loader_pids))
        return metrics

    def serve(
        self,
        liveness: Liveness,
        source_problem: Callable[[], str | None],
        unavailable: Callable[[], dict[str, str]] = dict,
        served: tuple[str, ...] = (),
    ) -> None:
        """From now on /livez says whether only a restart mends the worker (its device
        failed, else stalled), /readyz that or the task source's problem, or that no served
        pipeline can be loaded (``unavailable``: pipeline -> why), and
        ``inference_worker_ready`` whether /readyz answers 200."""

        def not_live() -> str | None:
            restart = liveness.restart_reason()
            if restart:
                return f"restart: {restart}"
            stalled = liveness.stalled_reason()
            return f"stalled: {stalled}" if stalled else None

        def not_ready() -> str | None:
            return not_live() or source_problem() or (ready_note() if none_available() else None)

        def ready_note() -> str | None:
            lost = unavailable()
            each = [f"{name} ({why})" for name, why in lost.items()]
            return f"pipelines unavailable on this host: {'; '.join(each)}" if each else None

        def none_available() -> bool:
            return bool(served) and set(served) <= set(unavailable())

        self._not_live, self._not_ready, self._ready_note = not_live, not_ready, ready_note
        self.registry.register(UnavailableCollector(served, unavailable))
        Gauge(
            f"{PREFIX}_ready",
            "1 while GET /readyz answers 200 (the worker takes work); 0 while it answers 503 "
            "(stalled, its device failed, or its task source's problem: /readyz says which).",
            registry=self.registry,
        ).set_function(lambda: 0.0 if not_ready() else 1.0)

    def collect_engine(
        self, metrics: Metrics, engine: Engine, served: ServedPipelines, device: str
    ) -> None:
        """The device's identity (read once, now that the device is claimed and the models are
        on it), the device's memory, the reads' and the models' collectors."""
        identity = read_identity(
            resolve_device(device), visible=os.environ.get("CUDA_VISIBLE_DEVICES")
        )
        metrics.device.info(identity.labels())
        metrics.registry.register(
            DeviceCollector(
                lambda: memory_bytes(resolve_device(device)), lambda: engine.out_of_memory
            )
        )
        metrics.registry.register(ReadsCollector(engine.reads, lambda: dict(engine.read_retries)))
        metrics.registry.register(ModelsCollector(served.cache, served.names))

    @property
    def port(self) -> int:
        return self.server.port if self.server else 0

    @property
    def healthz_port(self) -> int:
        return (self.server.healthz_port or 0) if self.server else 0

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
