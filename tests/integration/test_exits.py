"""How `inference-worker run` ends, as supervisord sees it: each exit code observed from a
real process against a real nats-server and S3 endpoint, with what it gave back."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.helpers import (
    client,
    submit,
    take_back,
    upload_images,
    worker_env,
    worker_process,
)
from worker.commands.job_client import job_results
from worker.health.procstats import living
from worker.nats.provision import provision

pytestmark = pytest.mark.integration
EXIT_WAIT_S = 90.0


@dataclass
class Ended:
    code: int
    log: str
    given_back: list[Any]  # tasks without a result that come back at once (not held)
    results: list[dict[str, Any]]
    published: int


async def run_until_it_exits(
    settings: Any, env: dict[str, str], job: str, uris: list[str], log_path: Path
) -> Ended:
    """Queue the job, start `run`, wait for it to end by itself; then take back, at once,
    every task without a result: none is left held until its ack wait runs out."""
    async with client(settings) as js:
        await provision(js, settings.nats, settings.model.pipeline)
        tasks = await submit(js, settings, job, uris)
        with worker_process(env, log_path) as proc:
            code = await asyncio.to_thread(proc.wait, EXIT_WAIT_S)
        results = await job_results(js, settings.nats, job)
        given_back = await take_back(js, settings, job, len(tasks) - len(results))
    return Ended(code, log_path.read_text(), given_back, results, len(tasks))


async def test_a_part_that_fails_ends_the_process_with_1_and_its_tasks_are_given_back(
    nats_server, s3_server, bucket, settings_for, tmp_path
):
    settings = settings_for(nats_server.url)
    fault = tmp_path / "fail-once"
    env = worker_env(
        settings, WORKER_FAULTS__WEDGE_ONCE_FILE=str(fault), WORKER_FAULTS__WEDGE_MODE="raise"
    )
    uris = upload_images(s3_server.client(), bucket, 8)

    ended = await run_until_it_exits(settings, env, "job-part", uris, tmp_path / "worker.log")

    assert fault.exists(), "the fault hook fired"
    assert ended.code == 1, ended.log[-3000:]
    assert "worker_part_failed" in ended.log
    assert "tasks_given_back" in ended.log
    assert ended.results == []
    assert len(ended.given_back) == ended.published, "every task it held was given back"


async def test_a_loader_failing_max_consecutive_failures_times_ends_the_process_with_3(
    nats_server, s3_server, bucket, settings_for, tmp_path
):
    settings = settings_for(nats_server.url)
    fault = tmp_path / "drop-once"
    env = worker_env(
        settings,
        WORKER_FAULTS__DROP_ONCE_FILE=str(fault),  # one image lost: the loader times out
        WORKER_LOADER__MAX_CONSECUTIVE_FAILURES="1",
        WORKER_LOADER__TIMEOUT_S="3",
        WORKER_S3__CONNECT_TIMEOUT_S="0.5",
        WORKER_S3__READ_TIMEOUT_S="1",
        WORKER_S3__MAX_ATTEMPTS="1",
    )
    uris = upload_images(s3_server.client(), bucket, 4)

    ended = await run_until_it_exits(settings, env, "job-loader", uris, tmp_path / "worker.log")

    assert fault.exists(), "the fault hook fired"
    assert ended.code == 3, ended.log[-3000:]
    assert "exiting_for_a_restart" in ended.log
    assert ended.results == []
    assert len(ended.given_back) == ended.published, "every task it held was given back"


async def test_crossing_max_open_fds_drains_the_worker_and_ends_the_process_with_4(
    nats_server, s3_server, bucket, settings_for, tmp_path
):
    settings = settings_for(nats_server.url)
    env = worker_env(settings, WORKER_GUARDS__MAX_OPEN_FDS="8", WORKER_GUARDS__CHECK_INTERVAL_S="0")
    uris = upload_images(s3_server.client(), bucket, 12)

    ended = await run_until_it_exits(settings, env, "job-fds", uris, tmp_path / "worker.log")

    assert ended.code == 4, ended.log[-3000:]
    assert "resource_limit_exceeded" in ended.log and "MAX_OPEN_FDS" in ended.log
    assert 0 < len(ended.results) < ended.published, "the batch in hand done, the rest not"
    assert {r["status"] for r in ended.results} == {"ok"}
    assert len(ended.given_back) == ended.published - len(ended.results), "the rest given back"


def _wait_for_line(log_path: Path, line: str, proc: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while line not in log_path.read_text():
        assert proc.poll() is None, log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no {line!r}: {log_path.read_text()[-3000:]}"
        time.sleep(0.1)


async def test_a_second_signal_during_a_drain_exits_at_once(
    nats_server, s3_server, bucket, settings_for, tmp_path
):
    settings = settings_for(nats_server.url)
    env = worker_env(
        settings,
        WORKER_FAULTS__WEDGE_ONCE_FILE=str(tmp_path / "wedge-once"),
        WORKER_FAULTS__WEDGE_MODE="sleep",  # the batch in hand never finishes
        WORKER_HEALTH__DRAIN_TIMEOUT_S="120",
        WORKER_NATS__ACK_WAIT_S="300",
    )
    uris = upload_images(s3_server.client(), bucket, 8)
    log_path = tmp_path / "worker.log"
    async with client(settings) as js:
        await provision(js, settings.nats, settings.model.pipeline)
        await submit(js, settings, "job-twice", uris)
    tree: list[int] = []
    with worker_process(env, log_path) as proc:
        try:
            _wait_for_line(log_path, "fault_hook_wedging_engine_thread", proc)
            tree = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
            proc.send_signal(signal.SIGTERM)
            # The drain has begun: what was waiting is given back; the batch in hand is not
            # done and will not be within the drain timeout (120 s).
            _wait_for_line(log_path, "tasks_given_back", proc)
            assert proc.poll() is None, "the first signal drains, it does not exit"
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(proc.wait, 20)
            left = living(tree)  # at once: the exit killed and reaped them before it went
        finally:
            for pid in tree:  # only if the exit failed to: a test leaves no process behind
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    assert code == 128 + signal.SIGTERM, log_path.read_text()[-3000:]
    # os._exit runs no finaliser, so the loader children and the fork server are killed first.
    assert tree and left == [], (tree, left)
    assert "second signal SIGTERM: exiting now" in log_path.read_text()
