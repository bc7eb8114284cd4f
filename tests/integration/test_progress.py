"""Job progress for the person who submits: `submit --wait` and `watch --job`, against a real
nats-server and a real worker, on a terminal (a pty) and off one."""

from __future__ import annotations

import asyncio
import os
import pty
import select
import subprocess
import sys
import time
from typing import IO

import pytest

from tests.helpers import cli, client, running_worker, submit, upload_images, worker_env
from worker.commands.demo_images import corrupt_bytes
from worker.commands.progress import Progress, render

pytestmark = pytest.mark.integration


def _on_a_terminal(
    args: list[str], env: dict[str, str], stdout: IO[bytes], timeout_s: float = 90
) -> tuple[int, str]:
    """Run the CLI with its stderr on a pty and its stdout to ``stdout``; what it drew on the
    pty, and its exit code. Reads until the pty closes or ``timeout_s`` passes; the process is
    killed if still running."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker", *args],
        env=env,
        stdout=stdout,
        stderr=follower,
    )
    os.close(follower)
    drawn = bytearray()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 0.5)
            if not ready:
                continue
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the pty closed: the process is gone
                break
            if not chunk:
                break
            drawn.extend(chunk)
        return proc.wait(5), drawn.decode(errors="replace")
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


async def test_submit_wait_follows_the_job_on_stderr_only_and_exits_10_when_a_task_ends_in_error(
    nats_server, s3_server, bucket, settings_for, tmp_path
):
    settings = settings_for(nats_server.url)
    s3 = s3_server.client()
    uris = upload_images(s3, bucket, 7)
    s3.put_object(Bucket=bucket, Key="broken.jpg", Body=corrupt_bytes())
    uris.append(f"s3://{bucket}/broken.jpg")
    env = worker_env(settings)
    with open(tmp_path / "stdout", "wb") as stdout:
        async with running_worker(settings):
            code, drawn = await asyncio.to_thread(
                _on_a_terminal,
                ["submit", "--job", "job-wait", "--wait", "--timeout-s", "60", *uris],
                env,
                stdout,
            )

    assert code == 10, drawn[-2000:]
    assert (tmp_path / "stdout").read_bytes() == b"", "with --wait, nothing on stdout"
    assert drawn.count("\r\x1b[K[") >= 2 and "#" in drawn, "a bar redrawn in place"
    assert drawn.rstrip().endswith("job job-wait: ok=7 error=1 missing=0")


async def test_watch_off_a_terminal_prints_lines_and_exits_11_when_tasks_are_missing(
    nats_server, s3_server, bucket, settings_for
):
    settings = settings_for(nats_server.url)
    uris = upload_images(s3_server.client(), bucket, 3)
    env = worker_env(settings)
    assert cli("provision", env=env).returncode == 0
    async with client(settings) as js:
        await submit(js, settings, "job-nobody", uris)  # no worker runs: nothing will come

    done = await asyncio.to_thread(
        cli, "watch", "--job", "job-nobody", "--timeout-s", "2", "--interval-s", "0.5", env=env
    )

    assert done.returncode == 11
    lines = done.stderr.strip().splitlines()
    assert "\r" not in done.stderr and len(lines) >= 3, "plain lines, one per interval"
    assert lines[0].startswith("0/3 ok=0 error=0 missing=3")
    assert lines[-1] == "job job-nobody: ok=0 error=0 missing=3"


async def test_watch_exits_11_when_tasks_are_missing_even_though_one_ended_in_error(
    nats_server, settings_for
):
    from worker.nats.parts import result_store

    settings = settings_for(nats_server.url)
    env = worker_env(settings)
    assert cli("provision", env=env).returncode == 0
    async with client(settings) as js:
        tasks = await submit(js, settings, "job-both", ["s3://b/1.jpg", "s3://b/2.jpg"])
        failed = {"task_id": tasks[0].id, "job_id": "job-both", "status": "error"}
        assert await result_store(js, settings.nats).store(failed) is True  # no worker runs

    done = await asyncio.to_thread(
        cli, "watch", "--job", "job-both", "--timeout-s", "1", "--interval-s", "0.5", env=env
    )

    assert done.stderr.strip().endswith("job job-both: ok=0 error=1 missing=1"), done.stderr
    assert done.returncode == 11, "missing wins over error"


async def test_watch_of_a_finished_job_exits_0(nats_server, s3_server, bucket, settings_for):
    settings = settings_for(nats_server.url)
    uris = upload_images(s3_server.client(), bucket, 2)
    env = worker_env(settings)
    async with running_worker(settings), client(settings) as js:
        await submit(js, settings, "job-done", uris)
        done = await asyncio.to_thread(cli, "watch", "--job", "job-done", env=env)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().endswith("job job-done: ok=2 error=0 missing=0")


def test_the_line_shows_counts_rate_and_eta():
    progress = Progress(total=10, ok=3, error=1, started_s=100.0)
    assert render(progress, 102.0, tty=False) == ("4/10 ok=3 error=1 missing=6 rate=2.0/s eta=3s")
    assert render(progress, 102.0, tty=True).startswith("[############..................] 4/10")


async def test_watch_of_a_job_without_tasks_says_so_and_exits_1(nats_server, settings_for):
    settings = settings_for(nats_server.url)
    env = worker_env(settings)
    assert cli("provision", env=env).returncode == 0
    done = await asyncio.to_thread(cli, "watch", "--job", "no-such-job", env=env)
    assert done.returncode == 1
    assert "job no-such-job: no tasks on tasks.*.no-such-job" in done.stderr
