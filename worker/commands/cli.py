"""``inference-worker`` / ``python -m worker``: run, demo, submit, results, check, provision,
register, models fetch."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import structlog

from config.errors import TransientError
from config.logging import configure_logging
from config.names import env_name
from config.settings import ConfigError, Settings, load_settings
from worker.core.exits import CommandExit, JobEnd


def _pipelines_epilog() -> str:
    """The pipelines served by name (``WORKER_MODEL__PIPELINE(S)``)."""
    from pipelines.registry import BUILT_IN, CATALOGUE

    return (
        f"pipelines by name ({env_name('model', 'pipelines')}): built in: "
        f"{', '.join(BUILT_IN)}; AMI's (their files under "
        f"{env_name('model', 'files_mirror')} when set): {', '.join(CATALOGUE)}"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inference-worker", description=__doc__, epilog=_pipelines_epilog()
    )
    parser.add_argument("--log-level", default=os.environ.get(env_name("log_level"), "INFO"))
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "run", help="run the worker until SIGTERM/SIGINT (settings from env/.env)"
    )
    run.add_argument(
        "--until-idle",
        action="store_true",
        help="burst mode: stop (drained, exit 0) once nothing is held and the consumer has "
        "nothing pending",
    )
    commands.add_parser("demo", help="a whole job on local servers, with a report; cleans up")
    _add_job_commands(commands)
    commands.add_parser(
        "check",
        help="validate settings and reach the task source (NATS, or Antenna with "
        "WORKER_SOURCE=antenna), S3 and the model",
    )
    commands.add_parser(
        "register",
        help="register the served pipeline with Antenna in WORKER_ANTENNA__PROJECT_IDS "
        "(idempotent)",
    )
    commands.add_parser("provision", help="create or update streams and the durable consumer")
    models = commands.add_parser("models", help="the served pipelines' model files")
    models_commands = models.add_subparsers(dest="models_command", required=True)
    models_commands.add_parser(
        "fetch",
        help="download every served pipeline's weights and labels into the host's cache "
        "(WORKER_MODEL__CACHE_DIR), checked; one line per file: URI, size, sha256, how pinned",
    )
    _add_healthwatch(commands)
    return parser


def _add_job_commands(commands: Any) -> None:
    """``submit``, ``watch`` and ``results``: a job's tasks in, its progress and results out."""
    submit = commands.add_parser("submit", help="publish one task per image for a job")
    submit.add_argument("--job", required=True, help="job id")
    submit.add_argument(
        "--pipeline",
        help=f"pipeline (default: {env_name('model', 'pipeline')}, or the first of "
        f"{env_name('model', 'pipelines')})",
    )
    submit.add_argument("uris", nargs="*", help="image URIs, or one s3://bucket/prefix/ to list")
    submit.add_argument(
        "--wait", action="store_true", help="then follow the job as `watch` does (exit 0/10/11)"
    )
    submit.add_argument("--timeout-s", type=float, default=3600.0, help="with --wait")
    follow = commands.add_parser(
        "watch",
        help="follow a job: live progress (ok, error, missing, rate, ETA), then the summary; "
        "exit 0 all ok, 10 some error, 11 some missing when it ends, 1 no tasks",
    )
    follow.add_argument("--job", required=True, help="job id")
    follow.add_argument(
        "--timeout-s", type=float, default=3600.0, help="stop following after this long"
    )
    follow.add_argument(
        "--interval-s",
        type=_positive,
        default=1.0,
        help="seconds between refreshes (lines off a terminal)",
    )
    results = commands.add_parser("results", help="print a job's results and a summary")
    results.add_argument("--job", required=True, help="job id")


def _add_healthwatch(commands: Any) -> None:
    """``healthwatch``, supervisord's event listener."""
    watch = commands.add_parser(
        "healthwatch", help="supervisord event listener: restart workers that stall or go silent"
    )
    watch.add_argument("--group", default="inference-worker", help="supervisord program name")
    watch.add_argument("--port-base", type=int, default=9460, help="metrics port of process 0")
    watch.add_argument("--failures", type=int, default=2, help="bad ticks in a row to restart")
    watch.add_argument(
        "--startup-grace-s",
        type=float,
        default=120.0,
        help="no probe of a process started less than this ago",
    )
    watch.add_argument(
        "--max-start-s",
        type=_positive,
        default=1800.0,
        help="a process answering `503 starting` is no strike until it has run this long "
        "(a big model from S3, many pipelines loaded at start)",
    )
    watch.add_argument(
        "--timeout-s", type=float, default=3.0, help="wait for /livez (all probed at once)"
    )
    watch.add_argument(
        "--healthz-port-base",
        type=int,
        default=0,
        help="loopback /livez (and /healthz) port of process 0, when the workers set "
        "WORKER_METRICS__HEALTHZ_PORT (default: --port-base + 1000, as the workers do)",
    )


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "healthwatch":
        from worker.commands import healthwatch

        return healthwatch.main(
            args.group,
            args.port_base,
            args.failures,
            args.startup_grace_s,
            args.timeout_s,
            args.healthz_port_base,
            args.max_start_s,
        )
    if args.command == "demo":
        configure_logging("WARNING")
        from worker.commands.demo import run_demo

        return asyncio.run(run_demo())
    try:
        settings = load_settings(for_worker=args.command in ("run", "check", "register", "models"))
    except ConfigError as error:
        configure_logging(args.log_level)
        for line in str(error).splitlines():
            print(f"config error: {line}", file=sys.stderr)
        return CommandExit.CONFIG
    # After the settings, so that the Antenna token is masked in every log line (an answer
    # of Antenna's may echo it); loading them logs nothing.
    configure_logging(args.log_level, secrets=(settings.antenna.token.get_secret_value(),))
    if args.command == "run":
        _set_allocator(settings)
    handlers: dict[str, Callable[[Settings, argparse.Namespace], Coroutine[Any, Any, int]]] = {
        "run": _run,
        "submit": _submit,
        "results": _results,
        "watch": _watch,
        "check": _check,
        "register": _register,
        "provision": _provision,
        "models": _models,
    }
    try:
        return asyncio.run(handlers[args.command](settings, args))
    except ConfigError as error:  # the pipeline: resolved when a command first needs it
        for line in str(error).splitlines():
            print(f"config error: {line}", file=sys.stderr)
        return CommandExit.CONFIG
    except TransientError as error:  # NATS not reachable, for a command that runs once
        print(f"error: {error}", file=sys.stderr)
        return CommandExit.FAILED


def _set_allocator(settings: Settings) -> None:
    """``worker run``'s C allocator (``worker/process/allocator.py``), logged: before
    ``asyncio.run`` starts any thread and before torch is imported."""
    from worker.process.allocator import for_process

    allocator = for_process(settings)
    structlog.get_logger(__name__).info("allocator", kept=allocator.kept, why=allocator.why)


async def _run(settings: Settings, args: argparse.Namespace) -> int:
    from config.faults import load_faults
    from worker.process.serve import serve

    # The tests' fault hooks (WORKER_FAULTS__*), outside the settings: read by run alone.
    return await serve(settings, until_idle=args.until_idle, faults=load_faults())


async def _connect_once(settings: Settings, command: str) -> Any:
    """NATS for a command that runs once: a TransientError (exit 1) when it cannot be reached
    within WORKER_NATS__COMMAND_CONNECT_TIMEOUT_S."""
    from worker.nats.connection import connect

    return await connect(
        settings.nats,
        name=f"inference-worker-{command}",
        give_up_after_s=settings.nats.command_connect_timeout_s,
    )


async def _submit(settings: Settings, args: argparse.Namespace) -> int:
    from nats.js.errors import APIError

    from worker.commands.job_client import list_s3_prefix, make_tasks, publish_tasks

    uris = list(args.uris)
    if len(uris) == 1 and uris[0].startswith("s3://") and uris[0].endswith("/"):
        import boto3

        client = boto3.client(
            "s3", endpoint_url=settings.s3.endpoint_url, region_name=settings.s3.region
        )
        uris = list_s3_prefix(client, uris[0])
    if not uris:
        print(
            "nothing to submit: give image URIs or an s3://bucket/prefix/ with objects",
            file=sys.stderr,
        )
        return CommandExit.FAILED
    from pipelines.registry import name_of

    pipeline = args.pipeline or name_of(settings.model.pipeline_entries()[0])
    nc = await _connect_once(settings, "submit")
    try:
        js = nc.jetstream()
        tasks = make_tasks(args.job, uris)
        try:
            published = await publish_tasks(js, settings.nats, pipeline, tasks)
        except APIError as refused:  # the stream is full (WORKER_NATS__TASKS_MAX_*), or absent
            print(
                f"error: the tasks stream refused a task of job {args.job}: {refused.description}"
                "; those published before it are queued, submitting again queues the rest",
                file=sys.stderr,
            )
            return CommandExit.FAILED
        said = f"submitted {published.new} tasks for job {args.job} on tasks.{pipeline}.<job>"
        if published.duplicates:
            said += (
                f"; {published.duplicates} more dropped by the stream as already submitted "
                "(their task ids were in its duplicate window)"
            )
        if not args.wait:
            print(said)
            return CommandExit.OK
        print(said, file=sys.stderr, flush=True)  # stdout stays empty with --wait
        ids = {task.id for task in tasks}
        return await _follow(js, settings, args.job, args.timeout_s, 1.0, ids)
    finally:
        await nc.close()


async def _watch(settings: Settings, args: argparse.Namespace) -> int:
    nc = await _connect_once(settings, "watch")
    try:
        return await _follow(nc.jetstream(), settings, args.job, args.timeout_s, args.interval_s)
    finally:
        await nc.close()


async def _follow(
    js: Any,
    settings: Settings,
    job: str,
    timeout_s: float,
    interval_s: float,
    expected: set[str] | None = None,
) -> int:
    """Progress on stderr (a bar on a terminal, lines otherwise); the exit code says how the
    job ended: 0 every task ok, 10 some ended in error, 11 some have no result yet (missing
    wins over error), 1 the job has no tasks on its subjects."""
    from nats.js.errors import APIError, NotFoundError

    from worker.commands.progress import watch_job

    try:
        progress = await watch_job(
            js,
            settings.nats,
            job,
            sys.stderr,
            timeout_s=timeout_s,
            interval_s=interval_s,
            expected=expected,
        )
    except NotFoundError as error:
        print(
            f"cannot follow job {job}: {error}; run `inference-worker provision`", file=sys.stderr
        )
        return JobEnd.NO_TASKS
    except APIError as refused:  # a busy server may refuse the results' reader
        print(f"error: NATS refused to let job {job} be followed: {refused}", file=sys.stderr)
        return CommandExit.FAILED
    return progress.exit_code()


async def _results(settings: Settings, args: argparse.Namespace) -> int:
    from nats.js.errors import APIError

    from worker.commands.job_client import job_task_ids, read_job_results, summarize

    nc = await _connect_once(settings, "results")
    try:
        js = nc.jetstream()
        read = await read_job_results(js, settings.nats, args.job)
        results = read.results
        expected = await job_task_ids(js, settings.nats, args.job)
    except APIError as refused:  # the stream is missing, or a busy server refused a reader
        print(f"error: cannot read job {args.job}: {refused}", file=sys.stderr)
        return CommandExit.FAILED
    finally:
        await nc.close()
    if not expected:  # its tasks are no longer kept (WORKER_NATS__TASKS_MAX_AGE_S)
        expected = {r["task_id"] for r in results}
        print(
            f"job {args.job}: its tasks are no longer kept; every result counted", file=sys.stderr
        )
    for result in sorted(results, key=lambda r: r["task_id"]):
        if result["task_id"] in expected:  # a result for another id is no result of the job
            print(json.dumps(result, sort_keys=True))
    print(summarize(results, expected, read.unreadable).line(), file=sys.stderr)
    return CommandExit.OK


async def _provision(settings: Settings, _args: argparse.Namespace) -> int:
    from pipelines.registry import name_of
    from worker.nats.provision import provision

    nc = await _connect_once(settings, "provision")
    try:
        pipelines = [name_of(entry) for entry in settings.model.pipeline_entries()]
        for line in await provision(nc.jetstream(), settings.nats, pipelines):
            print(line)
    finally:
        await nc.close()
    return CommandExit.OK


async def _check(settings: Settings, _args: argparse.Namespace) -> int:
    from config.settings import aliases_used
    from worker.commands.check import readiness_problems

    for line in aliases_used(settings):
        print(f"alias: {line}")
    problems = await readiness_problems(settings)
    for problem in problems:
        print(f"not ready: {problem}", file=sys.stderr)
    from worker.commands.model_files import pin_lines

    for line in await asyncio.to_thread(pin_lines, settings):
        print(line)
    source = "Antenna" if settings.source == "antenna" else "NATS"
    if not problems:
        print(f"ready: settings valid; {source}, S3 and the model reachable")
    return CommandExit.FAILED if problems else CommandExit.OK


async def _models(settings: Settings, _args: argparse.Namespace) -> int:
    from worker.commands.model_files import fetch_command

    return await asyncio.to_thread(fetch_command, settings)


async def _register(settings: Settings, _args: argparse.Namespace) -> int:
    from worker.commands.register import register_command

    return await register_command(settings)
