"""The tests mirror the package: each module of ``worker/``, ``pipelines/``, ``datasets/`` and
``config/`` has its own test file (``worker/core/claims.py``: ``tests/unit/core/test_claims.py``,
or ``tests/integration/test_claims.py`` where a real server is what it speaks to), or is listed
below with the reason it has none: a module of declarations with no behaviour of its own, or
one whose behaviour a named test file holds (that file must exist). A new module without
either fails here, and so does an entry for a module that is gone or has its file now."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).parents[2]
PACKAGES = ("worker", "pipelines", "datasets", "config")

# Declarations only: types, protocols, constants, wiring with no branch of its own.
DECLARATIONS = "declarations only, no behaviour of its own"

# module -> (the test file under tests/ that holds its behaviour, or "" for declarations; what
# of it that file holds).
NO_FILE_OF_ITS_OWN: dict[str, tuple[str, str]] = {
    "config/aliases.py": (
        "unit/antenna/test_source.py",
        "AMI's names read as aliases, ours winning",
    ),
    "config/cross_checks.py": (
        "unit/config/test_settings.py",
        "each rule across settings, as settings load",
    ),
    "config/derived.py": ("unit/config/test_settings.py", "values derived as settings load"),
    "config/logging.py": ("unit/antenna/test_source.py", "a secret masked in the log lines"),
    "config/unknown.py": (
        "unit/config/test_settings.py",
        "an unknown WORKER_ name refused as settings load",
    ),
    "datasets/budget.py": ("unit/datasets/test_reads.py", "the byte budget of an image read"),
    "datasets/faults.py": ("chaos/test_chaos.py", "the chaos scenarios install these faults"),
    "datasets/httpget.py": (
        "unit/datasets/test_uris.py",
        "http(s) images read from a real local server",
    ),
    "datasets/jpeg.py": ("unit/datasets/test_resize.py", "decoded beside PIL's decoder"),
    "datasets/processes.py": (
        "unit/datasets/test_rundir.py",
        "the loader's children and their run directory",
    ),
    "datasets/semaphores.py": (
        "unit/datasets/test_loader.py",
        "the loader's named semaphores, reaped",
    ),
    "pipelines/ami/category_map.py": (
        "unit/pipelines/ami/test_catalogue.py",
        "read with the catalogue",
    ),
    "pipelines/ami/layouts.py": (
        "unit/pipelines/ami/test_catalogue.py",
        "built with the catalogue",
    ),
    "pipelines/architectures.py": ("", DECLARATIONS + " (names to builders)"),
    "pipelines/declare.py": (
        "unit/pipelines/test_registry.py",
        "pipelines declared and registered",
    ),
    "pipelines/response.py": ("unit/pipelines/test_runner.py", "the runner's response per image"),
    "pipelines/shared.py": (
        "integration/test_pipelines_many.py",
        "stages shared by many pipelines, loaded once",
    ),
    "worker/antenna/catalog.py": (
        "unit/antenna/test_render.py",
        "the served pipelines' algorithms, rendered",
    ),
    "worker/antenna/identity.py": (
        "unit/antenna/test_source.py",
        "client info with each request, no secret",
    ),
    "worker/antenna/inactive.py": (
        "integration/test_antenna.py",
        "a job cancelled at Antenna, dropped",
    ),
    "worker/antenna/keepable.py": (
        "unit/antenna/test_registration.py",
        "a pipeline Antenna cannot keep, refused",
    ),
    "worker/antenna/parts.py": (
        "unit/antenna/test_job_listing.py",
        "the source's parts built from settings",
    ),
    "worker/antenna/post.py": (
        "unit/antenna/test_settle.py",
        "a result posted: the settler's wire action",
    ),
    "worker/antenna/schemas.py": ("", DECLARATIONS + " (Antenna's wire models)"),
    "worker/antenna/source_metrics.py": (
        "unit/test_metrics_documented.py",
        "the source's metrics, documented",
    ),
    "worker/antenna/waiting.py": (
        "unit/health/test_tasks_waiting.py",
        "tasks waiting, read from Antenna",
    ),
    "worker/commands/demo.py": ("integration/test_cli.py", "the demo run start to finish"),
    "worker/commands/demo_images.py": ("integration/test_workload.py", "the demo's images served"),
    "worker/commands/demo_models.py": ("integration/test_antenna.py", "the demo's models served"),
    "worker/commands/job_client.py": (
        "integration/test_cli.py",
        "submit, results, purge against NATS",
    ),
    "worker/commands/register.py": (
        "integration/test_antenna.py",
        "register against the fake Antenna",
    ),
    "worker/core/drain.py": (
        "unit/core/test_orchestrator.py",
        "the drain: the batch in hand finished, the rest given back, each wait bounded",
    ),
    "worker/core/dropping.py": (
        "integration/test_antenna.py",
        "held tasks of a cancelled job dropped",
    ),
    "worker/core/fetching.py": (
        "unit/core/test_orchestrator.py",
        "the fetch loop, its backoff and burst mode's end on a failing source",
    ),
    "worker/core/link.py": (
        "unit/core/test_orchestrator_sources.py",
        "each source's link to the core",
    ),
    "worker/core/outcome.py": ("", DECLARATIONS),
    "worker/core/ports.py": ("", DECLARATIONS + " (the core's protocols)"),
    "worker/core/preparing.py": (
        "unit/core/test_orchestrator.py",
        "models made ready for a batch, and retried in the background",
    ),
    "worker/core/results.py": ("unit/nats/test_settle.py", "the result a verdict keeps, stored"),
    "worker/core/settling.py": ("unit/core/test_orchestrator.py", "a batch's tasks settled"),
    "worker/core/threads.py": ("unit/core/test_orchestrator.py", "calls off the event loop"),
    "worker/engine/build.py": ("unit/engine/test_engine.py", "the engine built from its parts"),
    "worker/engine/collect.py": ("unit/engine/test_engine.py", "a batch's images collected"),
    "worker/engine/copy_ahead.py": ("unit/engine/test_engine.py", "the next batch copied ahead"),
    "worker/engine/faults.py": ("unit/health/test_watchdog.py", "the engine's chaos faults"),
    "worker/engine/forward.py": ("unit/engine/test_engine.py", "one forward pass per batch"),
    "worker/engine/predictors.py": ("unit/engine/test_engine.py", "a pipeline's predictor"),
    "worker/engine/read_stats.py": ("", DECLARATIONS),
    "worker/engine/served.py": (
        "unit/engine/test_engine.py",
        "the served pipelines' models on demand",
    ),
    "worker/engine/split.py": (
        "unit/engine/test_sticky_device_errors.py",
        "a batch split on a device error",
    ),
    "worker/engine/stash.py": ("unit/engine/test_engine.py", "loads kept until their batch runs"),
    "worker/health/guards.py": (
        "integration/test_exits.py",
        "the memory and descriptor guards end the process",
    ),
    "worker/health/observer.py": ("unit/core/test_batches.py", "health updated after each batch"),
    "worker/health/procstats.py": ("unit/process/test_serve.py", "the process tree's counters"),
    "worker/nats/algorithms.py": (
        "integration/test_workload.py",
        "the algorithms of a stored result",
    ),
    "worker/nats/consumer_deleter.py": (
        "integration/test_job_consumers.py",
        "a finished job's consumer deleted",
    ),
    "worker/nats/consumer_stats.py": ("", DECLARATIONS),
    "worker/nats/dead_letters.py": (
        "integration/test_nothing_lost.py",
        "a task naming none, dead-lettered",
    ),
    "worker/nats/delivery.py": (
        "integration/test_nothing_lost.py",
        "a JetStream message as the core's task",
    ),
    "worker/nats/faults.py": ("chaos/test_chaos.py", "the NATS faults of the chaos scenarios"),
    "worker/nats/feed.py": ("integration/test_jobs.py", "the feed's fetches across job consumers"),
    "worker/nats/hints.py": (
        "integration/test_job_hints.py",
        "a new job heard of and served at once",
    ),
    "worker/nats/job_names.py": ("integration/test_job_consumers.py", "a job's consumer named"),
    "worker/nats/lifecycle.py": (
        "integration/test_job_consumers.py",
        "job consumers made and deleted",
    ),
    "worker/nats/patience.py": (
        "unit/nats/test_connection.py",
        "how long a request to JetStream waits",
    ),
    "worker/nats/render.py": ("unit/nats/test_settle.py", "the stored result document"),
    "worker/nats/source.py": ("unit/core/test_orchestrator_sources.py", "the NATS source's tasks"),
    "worker/nats/source_metrics.py": (
        "unit/test_metrics_documented.py",
        "the source's metrics, documented",
    ),
    "worker/nats/subjects.py": (
        "integration/test_consumer_settings.py",
        "the subjects of tasks and results",
    ),
    "worker/nats/waiting.py": (
        "unit/health/test_tasks_waiting.py",
        "tasks waiting, read from NATS",
    ),
    "worker/process/device_claim.py": (
        "unit/pipelines/test_device_identity.py",
        "the device claimed",
    ),
    "worker/process/pick_source.py": (
        "unit/process/test_app.py",
        "the one place a source is picked",
    ),
    "worker/process/pipeline_choice.py": (
        "unit/config/test_settings.py",
        "the served pipelines, checked",
    ),
}


def modules() -> list[str]:
    return sorted(
        str(path.relative_to(ROOT))
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if path.name not in ("__init__.py", "__main__.py")
    )


def own_test_files(module: str) -> list[Path]:
    """Where a module's own test file may be: the unit mirror of its path (``worker/`` left
    out: its rooms are the mirror's folders), or an integration test of the same name."""
    parts = Path(module).with_suffix("").parts
    room = parts[1:-1] if parts[0] == "worker" else parts[:-1]
    name = f"test_{parts[-1]}.py"
    return [ROOT / "tests" / "unit" / Path(*room, name), ROOT / "tests" / "integration" / name]


def test_every_module_has_its_test_file_or_a_reason():
    missing = [
        m
        for m in modules()
        if m not in NO_FILE_OF_ITS_OWN and not any(p.exists() for p in own_test_files(m))
    ]
    assert missing == [], "modules with no test file of their own and no reason listed"


def test_every_listed_reason_is_still_true():
    present = set(modules())
    for module, (held_by, why) in NO_FILE_OF_ITS_OWN.items():
        assert module in present, f"{module} is gone: take it off the list"
        assert not any(p.exists() for p in own_test_files(module)), f"{module} has its file now"
        assert why, f"{module}: no reason given"
        if held_by:
            assert (ROOT / "tests" / held_by).is_file(), f"{module}: {held_by} does not exist"
        else:
            assert why.startswith(DECLARATIONS), f"{module}: no test file names what holds it"
