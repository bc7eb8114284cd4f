"""A worker killed with its whole process group, again and again mid-job, leaves nothing
behind once a clean process with its index has started: no ``pymp-*`` directory in its temp
dir, no ``sem.mp-*`` or ``torch_*`` entry of the dead processes in /dev/shm, and the job
still ends with one result per task. A start refused for its settings removes nothing from
any run directory: not a live process's files, not a dead one's leftovers."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest

from config.derived import port_for
from config.names import env_name
from datasets.rundir import semprefix_for
from tests.helpers import (
    claimed_path,
    cli,
    client,
    run_dir_holder,
    start_run,
    submit,
    until_gone,
    upload_images,
    wait_results,
    worker_env,
)
from worker.commands.job_client import job_results
from worker.nats.provision import provision

pytestmark = pytest.mark.integration
KILLS = 4
INDEX = 7
SHM = Path("/dev/shm")

# Short timeouts: a task held by a killed worker comes back after a 4 s ack wait.
SHORT = {
    "nats": {"ack_wait_s": 4, "max_deliver": 10, "fetch_timeout_s": 0.3, "store_retry_s": 1},
    "loader": {"timeout_s": 1.5, "reads_per_worker": 1},
    "s3": {"connect_timeout_s": 0.3, "read_timeout_s": 0.4, "max_attempts": 1},
    "health": {
        "stall_timeout_s": 2,
        "drain_timeout_s": 1,
        "watchdog_timeout_s": 0,
        "warm_pass": False,  # tight budgets: no warm pass
    },
    "metrics": {"port": 0},
}


def as_env(groups: dict[str, dict[str, Any]]) -> dict[str, str]:
    """``settings_for``'s keyword groups as a worker process's environment."""
    return {
        env_name(group, name): str(value)
        for group, values in groups.items()
        for name, value in values.items()
    }


# The worker processes': the settings above, and the index whose run directory is watched.
ENV = {**as_env(SHORT), env_name("process_index"): str(INDEX)}


@pytest.fixture
def system_tmp(request) -> Path:
    """The workers' system temp dir: short (the fork server's Unix socket lives below it)."""
    path = Path(tempfile.mkdtemp(prefix="iw-tmp-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(path, ignore_errors=True))
    return path


def semaphores_mapped(pids: list[int]) -> set[str]:
    """/dev/shm/sem.* names the processes have mapped (unlinked ones included)."""
    names = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            if "/dev/shm/sem." in line:
                names.add(line.split("/dev/shm/", 1)[1].removesuffix(" (deleted)").strip())
    return names


def start(env: dict[str, str], log: Path, *args: str) -> subprocess.Popen[bytes]:
    return start_run(env, log, *args, own_group=True)  # as under supervisord


async def kill_group_mid_job(
    js, settings, proc: subprocess.Popen[bytes], log: Path, done_before: int
) -> tuple[list[int], set[str]]:
    """Once this worker has stored a result of its own: SIGKILL its whole group."""
    deadline = time.monotonic() + 90
    while len(await job_results(js, settings.nats, "job-killed")) <= done_before:
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no progress: {log.read_text()[-3000:]}"
        await asyncio.sleep(0.1)
    tree = [proc.pid, *(p.pid for p in psutil.Process(proc.pid).children(recursive=True))]
    mapped = semaphores_mapped(tree)
    os.killpg(proc.pid, signal.SIGKILL)
    await asyncio.to_thread(proc.wait, 10)
    return tree, mapped


@pytest.mark.timeout(300)  # 77 s quiet, 141 s beside two busy loops (2026-12-03)
async def test_group_kills_mid_job_leave_nothing_once_a_clean_process_starts(
    nats_server, s3_server, bucket, settings_for, tmp_path, system_tmp
):
    from testing.shapednet import Shape, ShapedProxy

    settings = settings_for(nats_server.url, **SHORT)
    uris = upload_images(s3_server.client(), bucket, 60)
    run_dir = system_tmp / f"inference-worker-{os.geteuid()}" / f"process-{INDEX}"
    log = tmp_path / "worker.log"
    # Reads of 0.2 s, one at a time per child: a kill lands in the middle of the job.
    slow = Shape(first_byte_median_s=0.2, first_byte_p99_s=0.2, bytes_per_s=0.0)
    killed: list[int] = []
    mapped: set[str] = set()
    async with client(settings) as js:
        await provision(js, settings.nats, settings.model.pipeline)
        tasks = await submit(js, settings, "job-killed", uris)
        with ShapedProxy(s3_server.port, slow) as proxy:
            env = worker_env(settings, TMPDIR=str(system_tmp), WORKER_S3__ENDPOINT_URL=proxy.url)
            env.update(ENV)
            for _ in range(KILLS):
                done = len(await job_results(js, settings.nats, "job-killed"))
                proc = start(env, log)
                try:
                    tree, seen = await kill_group_mid_job(js, settings, proc, log, done)
                finally:
                    if proc.poll() is None:
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait(10)
                assert until_gone(tree) == []
                killed += tree
                mapped |= seen
            partial = len(await job_results(js, settings.nats, "job-killed"))
            left_by_kills = sorted(p.name for p in run_dir.rglob("pymp-*"))
            clean = start(env, log, "--until-idle")
            code = await asyncio.to_thread(clean.wait, 180)
        results = await wait_results(js, settings, "job-killed", len(tasks), timeout_s=10)

    text = log.read_text()
    assert code == 0, text[-3000:]
    assert 0 < partial < len(tasks)  # every kill came mid-job
    assert sorted(r["task_id"] for r in results) == sorted(t.id for t in tasks)
    # The kills did leave their temp dirs, and only in the run directory...
    assert left_by_kills, "no pymp-* directory of the killed workers in their run directory"
    assert "run_dir_emptied" in text
    # ...which the clean process emptied: nothing else in the workers' temp dir.
    everything = sorted(str(p.relative_to(system_tmp)) for p in system_tmp.rglob("*"))
    assert not [p for p in everything if "pymp-" in p], everything
    assert {Path(p).parts[0] for p in everything} <= {run_dir.parent.name}, everything
    assert {Path(p).parts[1] for p in everything if len(Path(p).parts) > 1} == {run_dir.name}
    # /dev/shm: the killed processes' semaphores carried the run dir's prefix, and are gone.
    prefix = "sem." + semprefix_for(run_dir).lstrip("/") + "-"
    # (The creator maps glibc's temporary name; a process that opens one maps the real one.)
    opened = {name for name in mapped if name.startswith("sem.mp")}
    assert opened and all(name.startswith(prefix) for name in opened), mapped
    shm = os.listdir(SHM)
    assert not [n for n in shm if n.startswith(prefix)]
    assert not [n for n in shm for pid in killed if n.startswith(f"torch_{pid}_")]


def listing(base: Path) -> list[str]:
    """Every path below ``base``, relative to it."""
    return sorted(str(path.relative_to(base)) for path in base.rglob("*"))


@contextmanager
def refused_by(refusal: str) -> Iterator[tuple[dict[str, str], str]]:
    """The settings that refuse a start after its run directory is claimed, and the setting
    its config error names."""
    if refusal == "port":
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen(1)
            port = env_name("metrics", "port")
            # Each process listens on the base port plus its index.
            first = taken.getsockname()[1] - INDEX
            assert port_for(first, INDEX) == taken.getsockname()[1]
            yield {port: str(first)}, port
    else:
        budget = env_name("model", "memory_budget_bytes")
        yield {budget: "1"}, budget


@pytest.mark.parametrize("refusal", ["port", "budget"], ids=["port held", "budget too small"])
def test_a_start_refused_for_its_settings_removes_nothing_from_any_run_directory(
    refusal, nats_server, settings_for, system_tmp
):
    # Given a live process in the first slot of index 7, and a killed overlap's leftovers
    # (a pymp-* dir, its mark, its lock file, a semaphore) in the two slots after it
    base = system_tmp / "run"
    live = run_dir_holder(base, INDEX)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(10)
    semaphores = []
    try:
        assert claimed_path(live) == base / f"process-{INDEX}"
        for slot in (base / f"process-{INDEX}.1", base / f"process-{INDEX}.2"):
            slot.mkdir(mode=0o700)
            for name in ("pymp-left", f"pid-{dead.pid}-1", "owner.lock"):
                (slot / name).mkdir() if name.startswith("pymp") else (slot / name).touch()
            semaphores.append(SHM / f"sem.{semprefix_for(slot).lstrip('/')}-left")
            semaphores[-1].touch()
        before = listing(base)
        # When a worker with index 7 starts and is refused for its settings
        settings = settings_for(nats_server.url)
        with refused_by(refusal) as (refusing, setting):
            env = {**worker_env(settings, WORKER_RUN_DIR=str(base)), **ENV, **refusing}
            done = cli("run", env=env, timeout=90)
        # Then it exits 2 naming the setting, and every run directory holds what it held
        assert done.returncode == 2, done.stderr[-3000:]
        errors = [line for line in done.stderr.splitlines() if line.startswith("config error:")]
        assert errors and setting in errors[0], done.stderr[-3000:]
        assert "run_dir_emptied" not in done.stderr
        assert listing(base) == before
        assert all(semaphore.exists() for semaphore in semaphores)
    finally:
        live.stdin.close()  # type: ignore[union-attr]
        live.wait(10)
        for semaphore in semaphores:
            semaphore.unlink(missing_ok=True)
