"""``inference-worker register``: every served pipeline's ``PipelineConfigResponse`` posted,
in one call, to each project in ``WORKER_ANTENNA__PROJECT_IDS``; one line per project, then
each algorithm's Antenna key once every project took them; exit 1 if any project failed, or
if a pipeline is one Antenna cannot keep the results of (``worker/antenna/keepable.py``)."""

from __future__ import annotations

import asyncio
import sys

from config.names import env_name
from config.settings import Settings
from worker.antenna.render import AntennaPipeline
from worker.core.exits import CommandExit


def _served(settings: Settings) -> list[AntennaPipeline]:
    """Each pipeline with its stages loaded (keys need the weights' sha256, maps their
    labels), one at a time: only one pipeline's models are in memory at once."""
    from config.derived import chosen_device
    from pipelines.device import release_cached_memory, visibility
    from pipelines.runner import load_runner
    from pipelines.setup import choose_all
    from worker.antenna.parts import pipeline_entry
    from worker.engine.build import model_files, source_config

    _visible, device = visibility(chosen_device(settings))
    sources, files = source_config(settings), model_files(settings)
    pipelines = []
    for chosen in choose_all(settings):
        runner = load_runner(
            chosen.pipeline, sources, device, chosen.limits, chosen.response_format, files=files
        )
        pipelines.append(pipeline_entry(chosen.pipeline, runner.algorithms()))
        del runner
        release_cached_memory()
    return pipelines


def _refused(settings: Settings) -> list[str]:
    """The served pipelines Antenna could not keep the results of (no models loaded)."""
    from pipelines.setup import choose_all
    from worker.antenna.keepable import refusals

    return refusals([c.pipeline for c in choose_all(settings)])


async def register_command(settings: Settings) -> int:
    from worker.antenna.client import AntennaClient
    from worker.antenna.registration import project_ids, register

    a = settings.antenna
    try:
        projects = project_ids(a.project_ids)
    except ValueError as error:
        print(f"config error: {error}", file=sys.stderr)
        return CommandExit.CONFIG
    if not a.base_url or not projects:
        print(
            f"config error: register needs {env_name('antenna', 'base_url')} and "
            f"{env_name('antenna', 'project_ids')}",
            file=sys.stderr,
        )
        return CommandExit.CONFIG
    refused = await asyncio.to_thread(_refused, settings)
    if refused:
        for line in refused:
            print(f"not registered: {line}", file=sys.stderr)
        return CommandExit.FAILED
    pipelines = await asyncio.to_thread(_served, settings)
    client = AntennaClient(a.base_url, a.token, a.request_timeout_s, scheme=a.auth_scheme)
    lines = await register(client, pipelines, projects, a.service_name)
    for ok, line in lines:
        print(line if ok else f"not registered: {line}", file=sys.stdout if ok else sys.stderr)
    if not all(ok for ok, _ in lines):
        return CommandExit.FAILED  # no algorithm lines: nothing of them may be in Antenna
    for pipeline in pipelines:
        for algorithm in pipeline.config()["algorithms"]:
            print(f"algorithm {algorithm['key']} ({algorithm['task_type']}) of {pipeline.slug}")
    return CommandExit.OK
