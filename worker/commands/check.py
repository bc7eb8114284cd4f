"""``inference-worker check``: one clear line per thing that stops a worker from working."""

from __future__ import annotations

import asyncio

import nats
from nats.js.errors import NotFoundError

from config.errors import WorkerError
from config.redact import redact_url, scrub
from config.settings import Settings

_CHECK_TIMEOUT_S = 10.0


async def _nats_problems(settings: Settings) -> list[str]:
    shown = ", ".join(redact_url(url.strip()) for url in settings.nats.url.split(","))
    try:
        nc = await asyncio.wait_for(
            nats.connect(
                settings.nats.url.split(","),
                allow_reconnect=False,
                connect_timeout=5,
                max_reconnect_attempts=0,
            ),
            _CHECK_TIMEOUT_S,
        )
    except Exception as error:  # noqa: BLE001 - any failure is the answer here
        return [f"NATS at {shown} unreachable: {type(error).__name__} {scrub(str(error))}"]
    problems = []
    try:
        js = nc.jetstream()
        for stream in (settings.nats.tasks_stream, settings.nats.results_stream):
            try:
                await js.stream_info(stream)
            except NotFoundError:
                problems.append(f"stream {stream} missing; run `inference-worker provision`")
    except Exception as error:  # noqa: BLE001 - reported as a problem line
        problems.append(f"JetStream not available at {shown}: {scrub(str(error))}")
    finally:
        await nc.close()
    return problems


def _model_problems(settings: Settings) -> list[str]:
    from config.derived import chosen_device
    from pipelines.device import visibility
    from pipelines.runner import load_runner
    from pipelines.setup import choose
    from worker.app import source_config

    try:
        chosen = choose(settings)
        _visible, device = visibility(chosen_device(settings))  # check reads; it sets nothing
        load_runner(chosen.pipeline, source_config(settings), device, chosen.output)
    except WorkerError as error:
        return [f"model: {line}" for line in str(error).splitlines()]
    except Exception as error:  # noqa: BLE001 - reported as a problem line
        return [f"model: cannot load {settings.model.pipeline}: {type(error).__name__} {error}"]
    return []


async def readiness_problems(settings: Settings) -> list[str]:
    problems = await _nats_problems(settings)
    problems += await asyncio.to_thread(_model_problems, settings)
    return problems
