"""The engine from the settings: the served pipelines' models (loaded on demand, or at start
as many as fit), the loader with its children, and the faults a test may ask for."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import structlog

from config.derived import max_held_tasks, object_deadline_s, torch_threads
from config.errors import ConfigError, ModelLoadFailed, TransientError
from config.faults import FaultSettings
from config.model_cache import cache_root
from config.names import env_name
from config.settings import Settings
from datasets.loader import LoaderConfig, StreamingLoader
from datasets.uris import SourceConfig
from pipelines.device import release_cached_memory, sticky_cause
from pipelines.files.fetch import ModelFiles, Pins, is_remote
from pipelines.models import stage_files
from pipelines.runner import load_runner
from pipelines.setup import Chosen
from worker.core.ports import BatchEngine
from worker.core.threads import in_daemon_thread
from worker.engine import Engine
from worker.engine.cores import available_cores
from worker.engine.served import ServedPipelines
from worker.engine.split import device_failed
from worker.health.liveness import Liveness

log = structlog.get_logger(__name__)


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


def model_files(s: Settings) -> ModelFiles:
    """The host's model-file cache (WORKER_MODEL__CACHE_DIR, or the per-user default), AMI's
    hosts and sizes, the operator's digests (whether the cache is the worker's own was checked
    with the settings: ``config.cross_checks.worker_problems``)."""
    from pipelines.ami.catalogue import file_hosts

    m = s.model
    return ModelFiles(
        source_config(s),
        cache_root(m.cache_dir, os.environ),
        m.file_max_bytes,
        m.download_deadline_s,
        file_hosts(m.files_mirror, tuple(m.files_hosts), m.published_digests),
        Pins(dict(m.file_digests), m.require_digests),
    )


def served_pipelines(
    s: Settings,
    chosen: list[Chosen],
    device: str,
    budget_bytes: int,
    faults: FaultSettings,
    progress: Callable[[], None] = lambda: None,
) -> ServedPipelines:
    """The served pipelines' models, none loaded yet, under ``budget_bytes``; each calls
    ``progress`` as each chunk of a batch's forward pass is done (liveness's ``advanced``)."""
    sources = source_config(s)
    files = model_files(s)

    def load(c: Chosen) -> Any:
        runner = load_runner(
            c.pipeline, sources, device, c.limits, c.response_format, s.model.precision, files
        )
        runner.progress = progress
        return runner

    def prefetch(c: Chosen) -> None:  # remote files into the host's cache, outside the load lock
        for uri, digest in stage_files([c.pipeline]):
            if is_remote(uri) and not files.status(uri, digest)[1]:
                files.fetch(uri, digest)

    return ServedPipelines(
        chosen,
        _with_slow_load(faults, load),
        budget_bytes,
        unloaded=lambda _name: release_cached_memory(),
        prefetch=prefetch,
    )


def loader(s: Settings, chosen: list[Chosen], faults: FaultSettings) -> StreamingLoader:
    """The loader (not started), sized to the tasks held: as many as the largest image any
    served pipeline can load allows. Each task's own decode plan travels with it."""
    held = max_held_tasks(s, max(c.plan.max_image_bytes() for c in chosen))
    config = LoaderConfig(
        num_workers=s.loader.num_workers,
        timeout_s=s.loader.timeout_s,
        plan=chosen[0].plan,
        sources=source_config(s),
        mp_context=s.loader.mp_context,
        prefetch_per_worker=-(-held // s.loader.num_workers) + 1,
    )
    if faults.drop_once_file:
        from datasets.faults import dropping_once

        return StreamingLoader(config, dropping_once(faults.drop_once_file))
    return StreamingLoader(config)


async def start_engine(
    s: Settings,
    served: ServedPipelines,
    started_loader: StreamingLoader,
    engine_thread: Executor,
    liveness: Liveness,
) -> Engine:
    """The loader's children started (on the engine thread, which owns the loader) while the
    models load: the fork server's imports and the weights overlap, so a restarted process
    answers /healthz sooner. A failure of either closes the loader and is the start's."""
    import torch

    cores = available_cores()
    threads, why = torch_threads(s, cores, served.detecting())
    torch.set_num_threads(threads)
    log.info("torch_threads", threads=threads, cores=cores, why=why)
    at_start = s.model.load_at_start
    if at_start is None:
        at_start = len(served.names) == 1  # one pipeline: loaded and checked at start, as ever
    names = served.names if at_start else []
    loop = asyncio.get_running_loop()
    started, preloaded = await asyncio.gather(
        loop.run_in_executor(engine_thread, started_loader.start),
        _within_deadline(
            in_daemon_thread(_preload, served, names), s.model.load_deadline_s * len(names)
        ),
        return_exceptions=True,
    )
    failed = next((r for r in (preloaded, started) if isinstance(r, BaseException)), None)
    if failed is None and s.health.warm_pass:
        failed = await _warm_pass(s, served)
    if failed is not None:
        await loop.run_in_executor(engine_thread, started_loader.close)
        raise failed
    return Engine(
        started_loader,
        models=served,
        plans=served.plans(),
        max_consecutive_failures=s.loader.max_consecutive_failures,
        heartbeat=liveness.still_working,
    )


async def _within_deadline(preloading: asyncio.Future[None], deadline_s: float) -> None:
    """The models loaded at start, within their load deadline (one per pipeline): past it the
    start fails (exit 1, a restart may find the file host answering), not a process left
    ``starting`` until healthwatch's bound. The load's thread is a daemon: it ends with us."""
    if deadline_s <= 0:
        return await preloading
    done, _ = await asyncio.wait({preloading}, timeout=deadline_s)
    if done:
        return preloading.result()
    preloading.add_done_callback(lambda f: f.cancelled() or f.exception())  # read, never said
    setting = env_name("model", "load_deadline_s")
    raise TransientError(
        f"the models loaded at start did not finish within {deadline_s:g}s ({setting} per "
        "pipeline): exiting for a restart"
    )


async def _warm_pass(s: Settings, served: ServedPipelines) -> BaseException | None:
    """The warm pass of the pipelines loaded at start (``warm_pass.check``); its refusal."""
    from worker.engine import warm_pass

    runners = {name: served.cache.peek(name) for name in served.cache.resident()}
    try:
        await warm_pass.check(s, {name: r for name, r in runners.items() if r is not None})
    except Exception as error:  # noqa: BLE001 - the start's failure, raised by the caller
        return error
    return None


def _preload(served: ServedPipelines, names: list[str]) -> None:
    """Load ``names`` now, in order (the budget keeps the last that fit); a failure is the
    start's, as a single pipeline's always was (ConfigError: exit 2)."""
    for name in names:
        try:
            served.load(name)
        except ModelLoadFailed as failed:
            sticky = sticky_cause(failed.cause) if failed.cause is not None else None
            if sticky is not None:  # the device's fault, not the configuration's: exit 7
                raise device_failed(sticky) from sticky
            raise failed.cause or ConfigError(failed.failure.message) from None


def _with_slow_load(
    faults: FaultSettings, load: Callable[[Chosen], Any]
) -> Callable[[Chosen], Any]:
    """The model load, or one made slower when a test asks (WORKER_FAULTS__SLOW_LOAD_S)."""
    if not faults.slow_load_s:
        return load
    from worker.engine.faults import slow_loading

    return slow_loading(load, faults.slow_load_s)


def with_faults(faults: FaultSettings, engine: Engine) -> BatchEngine:
    """The engine, or the engine behind a fault a chaos test asked for (its models, for a
    device error: raised inside the forward pass, where a real one is)."""
    if faults.device_error_once_file:
        from worker.engine.faults import DeviceFaultModels

        engine.models = DeviceFaultModels(
            engine.models,
            faults.device_error_once_file,
            faults.device_error_at_batch,
            faults.device_error_type,
        )
    if faults.slow_forward_s or faults.freeze_forward_at:
        from worker.engine.faults import SlowForwardModels

        engine.models = SlowForwardModels(
            engine.models, faults.slow_forward_s, faults.freeze_forward_at
        )
    if not faults.wedge_once_file:
        return engine
    from worker.engine.faults import WedgingEngine

    return WedgingEngine(engine, faults.wedge_once_file, faults.wedge_mode)
