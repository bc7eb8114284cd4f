"""Scenario helpers: upload images, run a worker in-process, wait for results (bounded)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

from worker.commands.demo_images import image_bytes
from worker.commands.job_client import job_results, make_tasks, publish_tasks
from worker.commands.localservers import free_port, stop_process
from worker.core.tasks import Task
from worker.nats.connection import connect
from worker.process.app import Assembly

SIZES = [(640, 480), (1920, 1080), (300, 500), (1280, 720)]


def upload_images(s3: Any, bucket: str, count: int, prefix: str = "img") -> list[str]:
    uris = []
    for i in range(count):
        width, height = SIZES[i % len(SIZES)]
        key = f"{prefix}/{i:04d}.jpg"
        s3.put_object(Bucket=bucket, Key=key, Body=image_bytes(width, height, seed=i))
        uris.append(f"s3://{bucket}/{key}")
    return uris


@asynccontextmanager
async def running_worker(settings: Any, faults: Any = None) -> AsyncIterator[Assembly]:
    """A started worker, working in the background; drained and closed on exit. ``faults``:
    the test hooks it takes (``config.faults.FaultSettings``), or none."""
    app = Assembly(settings, faults=faults)
    stop = asyncio.Event()
    task: asyncio.Task[Any] | None = None
    try:
        await app.start()  # inside: a start that fails part-way is still closed
        task = asyncio.create_task(app.run(stop))
        yield app
    finally:
        stop.set()
        try:
            if task is not None:
                await asyncio.wait_for(task, 30)
        finally:
            await app.close()


@asynccontextmanager
async def client(settings: Any) -> AsyncIterator[Any]:
    nc = await connect(settings.nats, name="test-client", give_up_after_s=30)
    try:
        yield nc.jetstream()
    finally:
        await nc.close()


async def submit(js: Any, settings: Any, job_id: str, uris: list[str]) -> list[Task]:
    tasks = make_tasks(job_id, uris)
    await publish_tasks(js, settings.nats, settings.model.pipeline, tasks)
    return tasks


async def publish_raw(js: Any, settings: Any, payload: Any) -> None:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    await js.publish(f"tasks.{settings.model.pipeline}", data, stream=settings.nats.tasks_stream)


async def wait_results(
    js: Any, settings: Any, job_id: str, count: int, timeout_s: float = 60.0
) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    results: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        results = await job_results(js, settings.nats, job_id)
        if len(results) >= count:
            return results
        await asyncio.sleep(0.2)
    raise AssertionError(f"job {job_id}: {len(results)} of {count} results after {timeout_s}s")


async def quiescent(js: Any, settings: Any, timeout_s: float = 30.0) -> None:
    """Nothing pending or awaiting an ack on the tasks consumer nor on the max-deliveries
    consumer: no result can still be on its way, so its absence can be asserted."""
    from worker.nats.provision import consumer_names
    from worker.nats.subjects import advisory_consumer

    await consumer_idle(js, settings, timeout_s)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = await js.consumer_info(
            settings.nats.advisory_stream, advisory_consumer(consumer_names(settings.nats))
        )
        if info.num_pending == 0 and info.num_ack_pending == 0:
            return
        await asyncio.sleep(0.2)
    raise AssertionError("the max-deliveries consumer still has work")


async def take_back(
    js: Any,
    settings: Any,
    job: str,
    count: int,
    timeout_s: float = 10.0,
    *,
    hand_on: bool = False,
) -> list[Any]:
    """Fetch up to ``count`` of ``job``'s tasks within ``timeout_s``, from the consumer that
    serves them (the job's own with fair share, else the shared durable). A task a worker
    gave back (nak) comes at once; one a worker left unsettled only after its ack wait
    (minutes). ``hand_on``: nak them again, for the next worker."""
    import nats
    import nats.js.errors

    from worker.nats.job_consumers import job_consumer, job_consumer_config
    from worker.nats.provision import consumer_names
    from worker.nats.subjects import job_tasks_subject, subject_token

    durable = settings.nats.consumer
    if settings.nats.fair_jobs:
        subject = job_tasks_subject(settings.model.pipeline, subject_token(job))
        durable = job_consumer(consumer_names(settings.nats), subject)
        # As a worker would make it, should none have found the job before it stopped.
        await js.add_consumer(
            settings.nats.tasks_stream, job_consumer_config(settings.nats, subject)
        )
    sub = await js.pull_subscribe_bind(durable=durable, stream=settings.nats.tasks_stream)
    taken: list[Any] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(taken) < count and time.monotonic() < deadline:
            try:
                taken += await sub.fetch(count - len(taken), timeout=1)
            except nats.errors.TimeoutError:
                pass
        if hand_on:
            for msg in taken:
                await msg.nak()
    finally:
        await sub.unsubscribe()
    return taken


def until_gone(pids: list[int], timeout_s: float = 15.0) -> list[int]:
    """Poll until none of ``pids`` lives (zombies count as gone); return those still living."""
    from worker.health.procstats import living

    deadline = time.monotonic() + timeout_s
    while living(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return living(pids)


async def consumer_idle(js: Any, settings: Any, timeout_s: float = 15.0) -> Any:
    """Wait until the durable consumer, and every job's consumer (fair share), has nothing
    pending and nothing awaiting ack; their counts summed (``num_redelivered`` too)."""
    from types import SimpleNamespace

    deadline = time.monotonic() + timeout_s
    busy: list[str] = []
    while time.monotonic() < deadline:
        infos = [
            i
            for i in await js.consumers_info(settings.nats.tasks_stream)
            if i.name.startswith(settings.nats.consumer)
        ]
        busy = [
            f"{i.name}: pending={i.num_pending} ack_pending={i.num_ack_pending}"
            for i in infos
            if i.num_pending or i.num_ack_pending
        ]
        if not busy:
            return SimpleNamespace(
                num_pending=0,
                num_ack_pending=0,
                num_redelivered=sum(i.num_redelivered or 0 for i in infos),
                consumers=len(infos),
            )
        await asyncio.sleep(0.2)
    raise AssertionError(f"consumers still busy: {'; '.join(busy)}")


def worker_env(settings, *, inherit: bool = True, **extra: str) -> dict[str, str]:
    """The one builder of a worker process's environment: ``settings``' server, streams and
    model, quick timeouts, then ``extra``. ``inherit``: on top of this process's environment
    (less any ``WORKER_*``), else the ``WORKER_*`` variables alone (for a ``.env`` file)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")} if inherit else {}
    n = settings.nats
    env.update(
        {
            "WORKER_NATS__URL": n.url,
            "WORKER_NATS__TASKS_STREAM": n.tasks_stream,
            "WORKER_NATS__RESULTS_STREAM": n.results_stream,
            "WORKER_NATS__DEAD_LETTER_STREAM": n.dead_letter_stream,
            "WORKER_NATS__ADVISORY_STREAM": n.advisory_stream,
            "WORKER_NATS__CONSUMER": n.consumer,
            "WORKER_NATS__RESULT_OBJECTS": n.result_objects,
            "WORKER_NATS__ALGORITHMS": n.algorithms,
            "WORKER_NATS__FETCH_TIMEOUT_S": "0.5",
            "WORKER_S3__ENDPOINT_URL": settings.s3.endpoint_url or "",
            "WORKER_S3__CONNECT_TIMEOUT_S": "1",
            "WORKER_S3__READ_TIMEOUT_S": "3",
            "WORKER_S3__MAX_ATTEMPTS": "2",
            "WORKER_LOADER__NUM_WORKERS": "2",
            "WORKER_LOADER__BATCH_SIZE": "4",
            "WORKER_LOADER__TIMEOUT_S": "20",
            "WORKER_MODEL__PIPELINE": settings.model.pipeline,
            "WORKER_MODEL__WEIGHTS": settings.model.weights,
            "WORKER_MODEL__DEVICE": "cpu",
            "WORKER_MODEL__CACHE_DIR": os.environ.get("WORKER_MODEL__CACHE_DIR", ""),
            "WORKER_HEALTH__STALL_TIMEOUT_S": "30",
            "WORKER_LOG_LEVEL": "INFO",
        }
    )
    if inherit:  # a port of its own: the default 9464 is shared by the runners side by side
        env["WORKER_METRICS__PORT"] = str(free_port())
    env.update(extra)
    return env


def cli(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "worker", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def http_answer(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    """A GET's status and body, an HTTP error's too (a probe's 503 is its answer); OSError
    when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def wait_http(url: str, proc, log_path, timeout_s: float = 180) -> tuple[int, str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, (
            f"worker exited {proc.returncode}: {log_path.read_text()[-3000:]}"
        )
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return response.status, response.read().decode()
        except OSError:
            time.sleep(0.2)
    raise AssertionError(
        f"{url} did not answer within {timeout_s}s: {log_path.read_text()[-3000:]}"
    )


@contextmanager
def worker_process(env: dict[str, str], log_path: Any) -> Iterator[subprocess.Popen[bytes]]:
    """``inference-worker run`` as its own process; SIGTERM, then SIGKILL, on exit."""
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "worker", "run"],
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    try:
        yield proc
    finally:
        stop_process(proc, wait_s=30.0)


def run_dir_holder(base: Path, index: int) -> subprocess.Popen[str]:
    """A live process that claimed ``index``'s slot and uses it until its stdin closes."""
    script = textwrap.dedent(
        f"""
        import sys, tempfile
        from pathlib import Path
        from datasets import rundir
        run = rundir.claim(Path({str(base)!r}), {index})
        rundir.clear_leftovers(run)
        rundir.use(run)
        Path(tempfile.mkdtemp(prefix="pymp-"))
        print("PATH=" + str(run.path), flush=True)
        sys.stdin.read()
        """
    )
    return subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def claimed_path(proc: subprocess.Popen[str]) -> Path:
    """The slot a ``run_dir_holder`` claimed, once it says so."""
    for _ in range(20):  # the log lines, then ours
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if line.startswith("PATH="):
            return Path(line.removeprefix("PATH=").strip())
    raise AssertionError("the holder said no path")


def start_run(
    env: dict[str, str], log: Path, *args: str, own_group: bool = False
) -> subprocess.Popen[bytes]:
    """``worker run`` as a process, its output appended to ``log``; with ``own_group``, in a
    process group of its own, as under supervisord."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "worker", "run", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=own_group,
        )
