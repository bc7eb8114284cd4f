"""Wiring: build every layer from the settings once, run the worker, take it all down in order."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, TypeVar

import structlog
from prometheus_client import CollectorRegistry

from config.derived import (
    chosen_device,
    healthz_port,
    max_held_tasks,
    metrics_port,
    object_deadline_s,
    torch_threads,
)
from config.errors import ConfigError, ModelLoadFailed, PermanentError
from config.names import env_name
from config.settings import Settings
from datasets.loader import LoaderConfig, StreamingLoader
from datasets.sources import SourceConfig
from pipelines.device import default_budget_bytes, memory_bytes, release_cached_memory, visibility
from pipelines.models import resolve_device
from pipelines.runner import load_runner
from pipelines.setup import Chosen, budget_problems, choose_all
from worker.engine import Engine
from worker.exits import Exit
from worker.health.guards import ResourceGuard
from worker.health.liveness import Liveness
from worker.health.metrics import (
    PREFIX,
    DeviceCollector,
    JobConsumersCollector,
    Metrics,
    ModelsCollector,
    ReadsCollector,
)
from worker.health.procstats import ProcessTreeCollector
from worker.health.server import HealthServer
from worker.health.watchdog import Watchdog
from worker.nats.advisories import ExhaustedTasks
from worker.nats.connection import ConnectionState, connect
from worker.nats.feed import TaskFeed
from worker.nats.provision import provision, refuse_other_fair_jobs
from worker.orchestrator import Services, Worker
from worker.ports import BatchEngine
from worker.results import ResultStore, publish_algorithms
from worker.served import Served
from worker.settle import Settler
from worker.threads import in_daemon_thread

log = structlog.get_logger(__name__)
T = TypeVar("T")
_CLOSE_WAIT_S = 10.0


def _device_type(device: str) -> str:
    """``cuda`` or ``cpu``; a CUDA device that is not there is a configuration error (exit 2),
    as the pipeline's loading would say a moment later."""
    try:
        return resolve_device(device).type
    except PermanentError as error:
        raise ConfigError(str(error)) from None


def source_config(s: Settings) -> SourceConfig:
    return SourceConfig(
        s3_endpoint_url=s.s3.endpoint_url,
        s3_region=s.s3.region,
        connect_timeout_s=s.s3.connect_timeout_s,
        read_timeout_s=s.s3.read_timeout_s,
        max_attempts=s.s3.max_attempts,
        http_timeout_s=s.s3.http_timeout_s,
        file_roots=s.sources.roots(),
        allowed_hosts=s.sources.hosts(),
        max_bytes=s.sources.max_bytes,
        object_deadline_s=object_deadline_s(s),
        max_redirects=s.sources.max_redirects,
        reads_in_flight=s.loader.reads_per_worker,
        read_bytes_in_flight=s.loader.read_bytes_per_worker,
    )


def _preload(served: Served, names: list[str]) -> None:
    """Load ``names`` now, in order (the budget keeps the last that fit); a failure is the
    start's, as a single pipeline's always was (ConfigError: exit 2)."""
    for name in names:
        try:
            served.load(name)
        except ModelLoadFailed as failed:
            raise failed.cause or ConfigError(failed.failure.message) from None


def _claim_device(s: Settings) -> str:
    """The device this process runs on; a GPU by index or UUID, or a MIG slice, becomes the
    only one it sees (CUDA_VISIBLE_DEVICES, indexed as nvidia-smi's)."""
    visible, device = visibility(chosen_device(s))
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
        os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # index as nvidia-smi's
    return device


def _loader(s: Settings, chosen: list[Chosen], sources: SourceConfig) -> StreamingLoader:
    """The loader (not started), sized to the tasks held: as many as the largest image any
    served pipeline can load allows. Each task's own decode plan travels with it."""
    held = max_held_tasks(s, max(c.plan.max_image_bytes() for c in chosen))
    config = LoaderConfig(
        num_workers=s.loader.num_workers,
        timeout_s=s.loader.timeout_s,
        plan=chosen[0].plan,
        sources=sources,
        mp_context=s.loader.mp_context,
        prefetch_per_worker=-(-held // s.loader.num_workers) + 1,
    )
    if s.faults.drop_once_file:
        from datasets.faults import dropping_once

        return StreamingLoader(config, dropping_once(s.faults.drop_once_file))
    return StreamingLoader(config)


class WorkerApp:
    """One worker process's parts. ``start`` -> ``run(stop)`` -> ``close``, driven by
    ``worker.serve.Server`` (signals, the run directory, the process's exit code).

    ``start`` reads as the process map: the engine (model on the engine thread, the loader
    and its children), the transport (NATS connection, streams, the consumer), the health
    layer (liveness, metrics, /healthz), and the orchestrator over them.
    """

    def __init__(self, settings: Settings, *, until_idle: bool = False) -> None:
        self.settings = settings
        self.until_idle = until_idle
        self.engine_thread = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.nc: Any = None
        self.engine: Engine | None = None
        self.health: HealthServer | None = None
        self.registry = CollectorRegistry()
        self._unhealthy: Callable[[], str | None] = lambda: "starting: not serving tasks yet"
        self.worker: Worker | None = None
        self.feed: TaskFeed | None = None
        self.connection = ConnectionState()
        self.device = "cpu"
        self._loader: StreamingLoader | None = None
        self.antenna: Any = None  # worker.antenna.wiring.AntennaParts with WORKER_SOURCE=antenna

    async def start(self, checked: Callable[[], None] = lambda: None) -> None:
        """``checked`` is called once the start can no longer be refused for its settings
        (port, device, pipelines, memory budget: ConfigError, exit 2), before any child
        process starts: ``Server`` empties its run directory then."""
        s = self.settings
        self._listen()  # first: a port another process holds ends the start at once (exit 2)
        liveness = Liveness(
            s.health.stall_timeout_s,
            watchdog=Watchdog(s.health.watchdog_timeout_s) if s.health.watchdog_timeout_s else None,
        )
        # The device first: CUDA reads CUDA_VISIBLE_DEVICES once, and a plugin imported by
        # choose() may touch CUDA.
        self.device = _claim_device(s)
        chosen = self._choose()  # ConfigError before anything starts
        budget = self._budget_bytes(chosen)
        checked()
        engine, served = await self._build_engine(liveness, chosen, budget)
        if s.source == "antenna":
            services = await self._antenna_services(liveness, chosen, engine, served)
        else:
            services = await self._nats_services(liveness, chosen, engine, served)
        self.worker = Worker(s, services, until_idle=self.until_idle)
        log.info(
            "worker_started",
            source=s.source,
            pipelines=served.names,
            loaded=served.cache.resident(),
            memory_budget_bytes=served.cache.budget_bytes,
            loader_pids=engine.loader.child_pids(),
            max_deliver=getattr(services.settler, "max_deliver", None),
            metrics_port=self.health.port if self.health else 0,
            healthz_port=self.health.healthz_port if self.health else 0,
        )

    def _collect_engine(self, metrics: Metrics, engine: Engine, served: Served) -> None:
        metrics.registry.register(
            DeviceCollector(
                lambda: memory_bytes(resolve_device(self.device)), lambda: engine.out_of_memory
            )
        )
        metrics.registry.register(ReadsCollector(engine.reads, lambda: dict(engine.read_retries)))
        metrics.registry.register(ModelsCollector(served.cache, served.names))

    async def _nats_services(
        self, liveness: Liveness, chosen: list[Chosen], engine: Engine, served: Served
    ) -> Services:
        s = self.settings
        feed, store, settler = await self._build_transport(served)
        js = self.nc.jetstream()

        async def loaded(pipeline: str) -> None:
            runner = served.loaded(pipeline)
            if runner is not None:
                await publish_algorithms(js, s.nats, [a.config() for a in runner.algorithms()])

        for name in served.names:  # those loaded at start
            await loaded(name)
        connection = self.connection
        metrics = self._build_health(
            liveness,
            engine.loader.child_pids,
            lambda: connection.problem(s.health.disconnected_timeout_s) or feed.problem(),
        )
        metrics.registry.register(JobConsumersCollector(feed.job_stats))
        settler.count = lambda outcome: metrics.tasks.labels(outcome).inc()
        settler.completed_twice = metrics.results_already_stored.inc
        return self._services(
            Services(
                source=feed,
                store=store,
                settler=settler,
                engine=self._with_faults(engine),
                engine_thread=self.engine_thread,
                liveness=liveness,
                metrics=metrics,
                helpers=(("max-deliveries", ExhaustedTasks(js, s.nats, settler).run),),
                closed=self.connection.lost,
                loaded=loaded,
            ),
            chosen,
            engine,
            served,
        )

    async def _antenna_services(
        self, liveness: Liveness, chosen: list[Chosen], engine: Engine, served: Served
    ) -> Services:
        """Antenna's HTTP task API as the source (worker/antenna/): no NATS connection. The
        jobs of every served pipeline are listed; each pipeline's algorithm keys and category
        maps, which its results are checked against before they are posted, are taken as its
        models load (``Catalog``)."""
        from worker.antenna.catalog import Catalog
        from worker.antenna.wiring import AntennaParts
        from worker.antenna.wiring import served as antenna_served

        s = self.settings
        catalog = Catalog(served.names)
        pipelines = {c.pipeline.name: c.pipeline for c in chosen}

        async def loaded(name: str) -> None:
            runner = served.loaded(name)
            if runner is not None:
                catalog.add(antenna_served(pipelines[name], runner.algorithms()))

        for name in served.names:  # those loaded at start
            await loaded(name)
        self.antenna = parts = AntennaParts.build(s, catalog)
        metrics = self._build_health(
            liveness,
            engine.loader.child_pids,
            lambda: parts.problem(s.health.disconnected_timeout_s),
        )
        parts.attach(metrics.registry)
        parts.rules.count = lambda outcome: metrics.tasks.labels(outcome).inc()
        return self._services(
            Services(
                source=parts.source,
                store=parts.lookup,
                settler=parts.rules,
                engine=self._with_faults(engine),
                engine_thread=self.engine_thread,
                liveness=liveness,
                metrics=metrics,
                loaded=loaded,
                unserved=parts.unserved,
                finish_held_on_stop=True,  # a give-back costs the TTR and a delivery
                results_waiting=lambda: parts.poster.waiting() > 0,
            ),
            chosen,
            engine,
            served,
        )

    def _services(
        self, own: Services, chosen: list[Chosen], engine: Engine, served: Served
    ) -> Services:
        """A source's ``own`` services with what every source shares: the engine's and the
        models' metrics, the resource guard, the idle unloader, the largest image loaded."""
        s = self.settings
        self._collect_engine(own.metrics, engine, served)
        helpers = own.helpers
        if s.model.idle_unload_s > 0:
            helpers = (*helpers, ("idle-unload", self._unloading_idle(served)))
        return replace(
            own,
            guard=ResourceGuard(s.guards, engine.loader.child_pids).check,
            helpers=helpers,
            image_bytes=max(c.plan.max_image_bytes() for c in chosen),
        )

    def _choose(self) -> list[Chosen]:
        """Every served pipeline, checked; JPEGs left encoded only where CUDA decodes them."""
        chosen = choose_all(self.settings)
        if self.settings.source == "antenna":
            from worker.antenna.keepable import refusals

            refused = refusals([c.pipeline for c in chosen])
            if refused:
                raise ConfigError("\n".join(refused))
        if any(c.plan.encoded for c in chosen) and _device_type(self.device) != "cuda":
            log.warning("device_decode_without_cuda", hint="JPEGs are decoded by the loader")
            chosen = [replace(c, plan=replace(c.plan, encoded=False)) for c in chosen]
        return chosen

    def _budget_bytes(self, chosen: list[Chosen]) -> int:
        """The models' memory budget; ConfigError when a pipeline cannot fit it alone."""
        s = self.settings
        budget = s.model.memory_budget_bytes
        if not budget:
            budget = default_budget_bytes(resolve_device(self.device))
        problems = budget_problems(s, chosen, budget)
        if problems:
            raise ConfigError("\n".join(problems))
        return budget

    def _unloading_idle(self, served: Served) -> Any:
        """A helper: every so often, unload the pipelines idle for WORKER_MODEL__IDLE_UNLOAD_S
        (on the engine thread, between batches)."""
        idle_s = self.settings.model.idle_unload_s
        loop = asyncio.get_running_loop()

        async def run(stop: asyncio.Event) -> None:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), max(1.0, idle_s / 4))
                await loop.run_in_executor(self.engine_thread, served.cache.unload_idle, idle_s)

        return run

    async def _build_engine(
        self, liveness: Liveness, chosen: list[Chosen], budget_bytes: int
    ) -> tuple[Engine, Served]:
        """The served pipelines' models (loaded on demand, or at start as many as fit), and
        the loader with its children (started on the engine thread)."""
        s = self.settings
        loop = asyncio.get_running_loop()
        sources = source_config(s)
        import torch

        torch.set_num_threads(torch_threads(s, os.cpu_count()))
        device = self.device
        served = Served(
            chosen,
            self._with_slow_load(
                lambda c: load_runner(
                    c.pipeline, sources, device, c.limits, c.response_format, s.model.precision
                )
            ),
            budget_bytes,
            unloaded=lambda _name: release_cached_memory(),
        )
        loader = _loader(s, chosen, sources)
        self._loader = loader  # closed by close() even if this start is cancelled half-way
        # The loader's children start (on the engine thread, which owns the loader) while the
        # models load: the fork server's imports and the weights overlap, so a restarted
        # process answers /healthz sooner.
        at_start = s.model.load_at_start
        if at_start is None:
            at_start = len(chosen) == 1  # one pipeline: loaded and checked at start, as ever
        started, preloaded = await asyncio.gather(
            loop.run_in_executor(self.engine_thread, loader.start),
            in_daemon_thread(_preload, served, served.names if at_start else []),
            return_exceptions=True,
        )
        failed = next((r for r in (preloaded, started) if isinstance(r, BaseException)), None)
        if failed is not None:
            await loop.run_in_executor(self.engine_thread, loader.close)
            self._loader = None
            raise failed
        self.engine = Engine(
            loader,
            models=served,
            plans=served.plans(),
            max_consecutive_failures=s.loader.max_consecutive_failures,
            heartbeat=liveness.still_working,
        )
        return self.engine, served

    async def _build_transport(self, served: Served) -> tuple[TaskFeed, ResultStore, Settler]:
        """The connection, the streams and consumer (provisioned), the feed and the stores."""
        s = self.settings
        self.nc = nc = await connect(s.nats, state=self.connection)
        js = nc.jetstream()
        await refuse_other_fair_jobs(js, s.nats)
        await provision(js, s.nats, served.names)
        self.feed = TaskFeed(nc, s.nats, served.names)
        await self.feed.open()
        store = ResultStore(js, s.nats, lambda: int(nc.max_payload))
        max_deliver = await self.feed.max_deliver()
        default = served.default
        settler = Settler(js, store, s.nats, default, served.model_info(default), max_deliver)
        settler.model_of = served.model_info
        return self.feed, store, settler

    def _listen(self) -> None:
        """/metrics and /healthz, and healthwatch's loopback /healthz, when a port is set:
        bound before the model loads, answering ``starting`` (503) until the worker is built."""
        s = self.settings
        port = metrics_port(s)
        if not port:
            return
        try:
            self.health = HealthServer(
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
        self.health.start()

    def _build_health(
        self,
        liveness: Liveness,
        loader_pids: Callable[[], list[int]],
        source_problem: Callable[[], str | None] | None = None,
    ) -> Metrics:
        """Metrics in the registry the listeners serve; /healthz from now on says how the
        worker is. ``source_problem``: why the task source is unhealthy (by default, the NATS
        connection's)."""
        s = self.settings
        connection = self.connection
        problem = source_problem or (lambda: connection.problem(s.health.disconnected_timeout_s))
        metrics = Metrics(self.registry, liveness, connection.connected)
        self.registry.register(ProcessTreeCollector(PREFIX, loader_pids))

        def unhealthy() -> str | None:
            stalled = liveness.stalled_reason()
            if stalled:
                return f"stalled: {stalled}"
            return problem()

        self._unhealthy = unhealthy
        return metrics

    def _with_slow_load(self, load: Callable[[Chosen], Any]) -> Callable[[Chosen], Any]:
        """The model load, or one made slower when a test asks (WORKER_FAULTS__SLOW_LOAD_S)."""
        if not self.settings.faults.slow_load_s:
            return load
        from worker.faults import slow_loading

        return slow_loading(load, self.settings.faults.slow_load_s)

    def _with_faults(self, engine: Engine) -> BatchEngine:
        """The engine, or the engine behind a fault a chaos test asked for."""
        faults = self.settings.faults
        if not faults.wedge_once_file:
            return engine
        from worker.faults import WedgingEngine

        return WedgingEngine(engine, faults.wedge_once_file, faults.wedge_mode)

    async def run(self, stop: asyncio.Event) -> Exit:
        assert self.worker is not None, "start() first"
        return await self.worker.run(stop)

    async def close(self) -> None:
        """Stop loader children, the health server and the connection; each step bounded."""
        loop = asyncio.get_running_loop()
        # The engine, or, when a start was stopped before it had one, the loader it was
        # starting (on the engine thread: its close runs once that start has returned).
        loader = self.engine.loader if self.engine is not None else self._loader
        if loader is not None:
            closing = self.engine.close if self.engine is not None else loader.close
            try:
                await asyncio.wait_for(
                    loop.run_in_executor(self.engine_thread, closing), _CLOSE_WAIT_S
                )
            except TimeoutError:
                log.error(
                    "engine_close_timeout",
                    hint="the engine thread is wedged; killing children and the fork server",
                )
                await loop.run_in_executor(None, loader.kill_all)
        self.engine_thread.shutdown(wait=False, cancel_futures=True)
        if self.health is not None:
            self.health.close()
        if self.feed is not None:
            await self.feed.close()
        if self.antenna is not None:
            await self.antenna.poster.close()
            self.antenna.client.close()
        self.connection.closing = True
        if self.nc is not None and not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.drain(), _CLOSE_WAIT_S)
            except Exception:  # noqa: BLE001 - closing anyway
                await self.nc.close()
        log.info("worker_stopped")
