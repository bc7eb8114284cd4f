"""The process's health layer, composed: the listeners (/metrics, /healthz and healthwatch's
loopback /healthz), the metrics in their registry, and what /healthz answers (starting, then
restart when the device failed, stalled, or the task source's problem)."""

from __future__ import annotations

import os
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from config.derived import healthz_port, metrics_port
from config.errors import ConfigError
from config.names import env_name
from config.settings import Settings
from pipelines.device import memory_bytes
from pipelines.device_identity import read_identity
from pipelines.models import resolve_device
from worker.engine import Engine
from worker.health.liveness import Liveness
from worker.health.metrics import (
    PREFIX,
    DeviceCollector,
    Metrics,
    ModelsCollector,
    ReadsCollector,
)
from worker.health.procstats import ProcessTreeCollector
from worker.health.server import HealthServer
from worker.ports import SourceHealth
from worker.served import ServedPipelines

_STARTING = "starting: not serving tasks yet"


class ProcessHealth:
    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self.registry = CollectorRegistry()
        self.server: HealthServer | None = None
        self._unhealthy: Callable[[], str | None] = lambda: _STARTING

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
                lambda: self._unhealthy(),
                healthz_port=healthz_port(s),
            )
        except OSError as error:
            raise ConfigError(
                f"{env_name('metrics', 'port')}: {error.strerror or error} (another process "
                f"holds the port, or {env_name('metrics', 'host')} is not this host's address)"
            ) from None
        self.server.start()

    def serve(
        self,
        liveness: Liveness,
        loader_pids: Callable[[], list[int]],
        source: str,
        source_health: Callable[[], SourceHealth],
        source_problem: Callable[[], str | None],
    ) -> Metrics:
        """The metrics; /healthz from now on says how the worker is: to be restarted (its
        device failed), else stalled, else the task source's problem, else ok."""
        metrics = Metrics(self.registry, liveness, source, source_health)
        self.registry.register(ProcessTreeCollector(PREFIX, loader_pids))

        def unhealthy() -> str | None:
            restart = liveness.restart_reason()
            if restart:
                return f"restart: {restart}"
            stalled = liveness.stalled_reason()
            if stalled:
                return f"stalled: {stalled}"
            return source_problem()

        self._unhealthy = unhealthy
        return metrics

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
