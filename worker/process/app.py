"""One worker process: build every layer from the settings once, run, take it all down in
order. Each layer is built in a module of its own: the device claim (``device_claim``), the
pipelines (``pipeline_choice``) and their memory budget (``pipelines.setup``), the engine
(``engine.build``), the health layer (``health.compose``) and its metrics, and the task
source's parts, given those metrics and picked in ``pick_source``."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog

from config.faults import FaultSettings
from config.settings import Settings
from datasets.loader import StreamingLoader
from pipelines.setup import budget_bytes
from worker.core.availability import Availability
from worker.core.exits import Exit
from worker.core.link import SourceParts
from worker.core.orchestrator import Orchestrator, Services
from worker.core.ports import SourceHealth
from worker.engine import Engine
from worker.engine import build as engine_build
from worker.engine.served import ServedPipelines
from worker.health.compose import ProcessHealth
from worker.health.guards import ResourceGuard
from worker.health.liveness import Liveness
from worker.health.metrics import Metrics
from worker.health.watchdog import Watchdog
from worker.process import pipeline_choice
from worker.process.allocator import release_freed_memory
from worker.process.device_claim import claim_device
from worker.process.pick_source import refusals, source_parts
from worker.process.slices import core_settings

log = structlog.get_logger(__name__)
_CLOSE_WAIT_S = 10.0


class Assembly:
    """One worker process's parts. ``start`` -> ``run(stop)`` -> ``close``, driven by
    ``worker.process.serve.Lifetime`` (signals, the run directory, the process's exit code).

    ``start`` reads as the process map: the listeners, the device, the pipelines and their
    budget, the engine (model on the engine thread, the loader and its children), the metrics,
    the task source's parts (counting into them), the probes over them, and the orchestrator.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        until_idle: bool = False,
        faults: FaultSettings | None = None,  # test hooks (``config/faults.py``); None: off
    ) -> None:
        self.settings = settings
        self.until_idle = until_idle
        self.faults = faults if faults is not None else FaultSettings()
        self.engine_thread = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.health = ProcessHealth(settings)
        self.registry = self.health.registry
        self.engine: Engine | None = None
        self.parts: SourceParts | None = None
        self.worker: Orchestrator | None = None
        self.device = "cpu"
        self._opening_since = time.monotonic()  # when the source's parts began to open
        self._open = False  # whether they are
        self._loader: StreamingLoader | None = None

    async def start(self, checked: Callable[[], None] = lambda: None) -> None:
        """``checked`` is called once the start can no longer be refused for its settings
        (port, device, pipelines, memory budget: ConfigError, exit 2), before any child
        process starts: ``Lifetime`` empties its run directory then."""
        s = self.settings
        self.health.listen()  # first: a port another process holds ends the start at once
        liveness = Liveness(
            s.health.stall_timeout_s,
            watchdog=Watchdog(s.health.watchdog_timeout_s) if s.health.watchdog_timeout_s else None,
        )
        self.device = claim_device(s)  # before anything may touch CUDA
        chosen = pipeline_choice.choose(s, self.device, lambda p: refusals(s, p))
        budget = budget_bytes(s, self.device, chosen)
        checked()
        served = engine_build.served_pipelines(
            s, chosen, self.device, budget, self.faults, progress=liveness.advanced
        )
        # Closed by close() if the start stops.
        self._loader = engine_build.loader(s, chosen, self.faults)
        try:
            self.engine = await engine_build.start_engine(
                s, served, self._loader, self.engine_thread, liveness
            )
        except Exception:
            self._loader = None  # start_engine closed it (a cancel leaves it to close())
            raise
        # The metrics first: the source's parts count into them from their making. Until the
        # probes answer (``_services``), /livez and /readyz still say starting.
        metrics = self.health.metrics(
            liveness, self.engine.loader.child_pids, s.source, self._source_health, served.names
        )
        self.parts = parts = source_parts(
            s, served, chosen, metrics, self.faults
        )  # closed by close()
        self._opening_since = time.monotonic()
        await parts.open()
        self._open = True  # its health is read from now: the connection is made
        for name in served.names:  # those loaded at start
            await parts.loaded(name)
        image_bytes = max(c.plan.max_image_bytes() for c in chosen)
        self.worker = Orchestrator(
            core_settings(s, image_bytes),
            self._services(parts, liveness, metrics, served),
            until_idle=self.until_idle,
        )
        self._log_started(served, parts)

    def _log_started(self, served: ServedPipelines, parts: SourceParts) -> None:
        assert self.engine is not None
        log.info(
            "worker_started",
            source=self.settings.source,
            pipelines=served.names,
            loaded=served.cache.resident(),
            memory_budget_bytes=served.cache.budget_bytes,
            loader_pids=self.engine.loader.child_pids(),
            metrics_port=self.health.port,
            healthz_port=self.health.healthz_port,
            **parts.started(),
        )

    def _source_health(self) -> SourceHealth:
        """The source's, read by the metrics, which are made before the source's parts are
        open: not connected until they are, down since the start began opening them (a start
        waiting on an unreachable NATS server says so)."""
        if self.parts is not None and self._open:
            return self.parts.health()
        return SourceHealth(False, time.monotonic() - self._opening_since)

    def _services(
        self,
        parts: SourceParts,
        liveness: Liveness,
        metrics: Metrics,
        served: ServedPipelines,
    ) -> Services:
        """What the orchestrator talks to: the source's link, and what every source shares
        (the engine and its metrics, the resource guard, the idle unloader). The probes
        answer from now on."""
        s, engine = self.settings, self.engine
        assert engine is not None
        link = parts.link
        availability = Availability(s.model.load_retry_s, s.model.load_retry_max_s)
        self.health.serve(
            liveness,
            parts.problem,
            lambda: {n: f"{u.reason}: {u.error}" for n, u in availability.unavailable().items()},
            tuple(served.names),
        )
        self.health.collect_engine(metrics, engine, served, self.device)
        helpers: tuple[tuple[str, Any], ...] = ()
        if s.model.idle_unload_s > 0:
            helpers = (("idle-unload", self._unloading_idle(served)),)
        return Services(
            link=link,
            engine=engine_build.with_faults(self.faults, engine),
            engine_thread=self.engine_thread,
            liveness=liveness,
            metrics=metrics,
            guard=ResourceGuard(s.guards, engine.loader.child_pids).check,
            helpers=helpers,
            loaded=parts.loaded,
            availability=availability,
        )

    def _unloading_idle(self, served: ServedPipelines) -> Any:
        """A helper: every so often, unload the pipelines idle for WORKER_MODEL__IDLE_UNLOAD_S
        (on the engine thread, between batches)."""
        idle_s = self.settings.model.idle_unload_s
        loop = asyncio.get_running_loop()

        async def run(stop: asyncio.Event) -> None:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), max(1.0, idle_s / 4))
                if await loop.run_in_executor(
                    self.engine_thread, served.cache.unload_idle, idle_s
                ):  # their memory back to the kernel, when the allocator keeps what is freed
                    await loop.run_in_executor(self.engine_thread, release_freed_memory)

        return run

    async def run(self, stop: asyncio.Event) -> Exit:
        assert self.worker is not None, "start() first"
        return await self.worker.run(stop)

    async def close(self) -> None:
        """Stop the engine (loader children), the listeners and the source; each step
        bounded, whatever the start reached."""
        await self._close_engine()
        self.engine_thread.shutdown(wait=False, cancel_futures=True)
        self.health.close()
        if self.parts is not None:
            await self.parts.close()
        log.info("worker_stopped")

    async def _close_engine(self) -> None:
        """The engine, or, when a start was stopped before it had one, the loader it was
        starting (on the engine thread: its close runs once that start has returned)."""
        loop = asyncio.get_running_loop()
        loader = self.engine.loader if self.engine is not None else self._loader
        if loader is None:
            return
        closing = self.engine.close if self.engine is not None else loader.close
        try:
            await asyncio.wait_for(loop.run_in_executor(self.engine_thread, closing), _CLOSE_WAIT_S)
        except TimeoutError:
            log.error(
                "engine_close_timeout",
                hint="the engine thread is wedged; killing children and the fork server",
            )
            await loop.run_in_executor(None, loader.kill_all)
