"""``inference-worker check``: one clear line per thing that stops a worker from working."""

from __future__ import annotations

import asyncio

import nats
from nats.js.errors import NotFoundError

from config.errors import WorkerError
from config.names import env_name
from config.redact import redact_url, scrub
from config.settings import Settings
from worker.nats.auth import connect_options, refusal

_CHECK_TIMEOUT_S = 10.0


async def _quiet(_error: Exception) -> None:
    return None


async def _nats_problems(settings: Settings) -> list[str]:
    shown = ", ".join(redact_url(url.strip()) for url in settings.nats.url.split(","))
    try:
        nc = await asyncio.wait_for(
            nats.connect(
                settings.nats.url.split(","),
                allow_reconnect=False,
                connect_timeout=5,
                max_reconnect_attempts=0,
                error_cb=_quiet,  # the answer is the exception; nats-py would log a traceback
                **connect_options(settings.nats),
            ),
            _CHECK_TIMEOUT_S,
        )
    except Exception as error:  # noqa: BLE001 - any failure is the answer here
        refused = refusal(settings.nats, error)
        if refused:
            return [f"{refused} at {shown}"]
        if (
            isinstance(error, ConnectionResetError | BrokenPipeError)
            and settings.nats.tls_cert_file
        ):
            # TLS 1.3: the server judges the client certificate once the client's side of the
            # handshake is done, so its refusal can come as a reset rather than an alert (seen
            # with nats-server 2.15 on a busy machine); a server that is down refuses the connect.
            cert = env_name("nats", "tls_cert_file")
            return [
                f"NATS refused the client certificate from {cert} (the connection was reset "
                f"right after the TLS handshake) at {shown}"
            ]
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
    """Every served pipeline resolved, then loaded one at a time (one's models in memory at
    once): one line per problem, naming the pipeline that cannot load."""
    from config.derived import chosen_device
    from pipelines.device import release_cached_memory, visibility
    from pipelines.runner import load_runner
    from pipelines.setup import choose_all
    from worker.engine.build import model_files, source_config

    try:
        everything = choose_all(settings)
        _visible, device = visibility(chosen_device(settings))  # check reads; it sets nothing
    except WorkerError as error:
        return [f"model: {line}" for line in str(error).splitlines()]
    problems: list[str] = []
    if settings.source == "antenna":
        from worker.antenna.keepable import refusals

        problems += [f"model: {line}" for line in refusals([c.pipeline for c in everything])]
    for chosen in everything:
        try:
            runner = load_runner(
                chosen.pipeline,
                source_config(settings),
                device,
                chosen.limits,
                chosen.response_format,
                files=model_files(settings),
            )
            del runner
            release_cached_memory()
        except WorkerError as error:
            problems += [f"model: {line}" for line in str(error).splitlines()]
        except Exception as error:  # noqa: BLE001 - reported as a problem line
            name = chosen.pipeline.name
            problems.append(f"model: cannot load {name}: {type(error).__name__} {error}")
    return problems


async def _antenna_problems(settings: Settings) -> list[str]:
    from pipelines.registry import name_of
    from worker.antenna.client import AntennaClient
    from worker.antenna.registration import antenna_problems, project_ids

    a = settings.antenna
    if not a.base_url:
        return [f"{env_name('antenna', 'base_url')} (or AMI_ANTENNA_API_BASE_URL) is not set"]
    try:
        projects = project_ids(a.project_ids)
    except ValueError as error:
        return [str(error)]
    # The deadline ``run`` gives each call: a slow Antenna that ``run`` works with is no problem.
    client = AntennaClient(a.base_url, a.token, a.request_timeout_s, scheme=a.auth_scheme)
    token_set = bool(a.token.get_secret_value())
    slugs = [name_of(entry) for entry in settings.model.pipeline_entries()]
    return await antenna_problems(client, slugs, projects, token_set)


async def readiness_problems(settings: Settings) -> list[str]:
    if settings.source == "antenna":
        problems = await _antenna_problems(settings)
    else:
        problems = await _nats_problems(settings)
    problems += await asyncio.to_thread(_model_problems, settings)
    return problems
