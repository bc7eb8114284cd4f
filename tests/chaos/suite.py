"""The chaos suite: each fault injected mid-job against real servers, then counted.

For every scenario: tasks published, results stored, lost (must be 0), duplicate results
(must be 0), the highest delivery count, and the time from the fault until the job was whole.
``python -m tests.chaos`` runs them all and prints the table; ``tests/chaos/test_chaos.py`` runs
the same scenarios under pytest (CI).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from config.settings import NatsSettings, load_settings
from tests.chaos.servers import FlakyS3Proxy, NatsCluster
from tests.helpers import worker_env
from worker.commands.client import job_results, make_tasks, publish_tasks
from worker.commands.demo_images import corrupt_bytes, image_bytes, truncated_bytes
from worker.commands.localservers import NatsServer, S3Server
from worker.health.procstats import living
from worker.nats.connection import connect
from worker.nats.provision import provision

PIPELINE = "mobilenet-v3-small-classifier"
JOB_WAIT_S = 120.0


@dataclass
class Row:
    fault: str
    published: int
    stored: int
    lost: int
    duplicates: int
    ok: int
    error: int
    max_attempt: int
    recover_s: float
    note: str = ""

    @property
    def passed(self) -> bool:
        return self.lost == 0 and self.duplicates == 0


# Short budgets, so every fault is recovered within a test's time; on top of the suite's one
# builder of a worker's environment (tests.helpers.worker_env).
CHAOS_BUDGETS = {
    "WORKER_NATS__ACK_WAIT_S": "8",
    "WORKER_NATS__MAX_DELIVER": "4",
    "WORKER_NATS__NAK_BACKOFF_BASE_S": "0.5",
    "WORKER_NATS__NAK_BACKOFF_MAX_S": "4",
    "WORKER_NATS__PUBLISH_TIMEOUT_S": "2",
    "WORKER_NATS__STORE_RETRY_S": "6",
    "WORKER_S3__CONNECT_TIMEOUT_S": "0.5",
    "WORKER_S3__READ_TIMEOUT_S": "1",
    "WORKER_S3__MAX_ATTEMPTS": "2",
    "WORKER_LOADER__TIMEOUT_S": "4",
    "WORKER_HEALTH__STALL_TIMEOUT_S": "5",
    "WORKER_HEALTH__WATCHDOG_TIMEOUT_S": "7.5",
    "WORKER_HEALTH__DRAIN_TIMEOUT_S": "3",
    "WORKER_METRICS__PORT": "0",
}


class WorkerProc:
    """One `inference-worker run` process, its log in a file."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "worker", "run"],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.tree: list[int] = []

    def remember_tree(self) -> None:
        try:
            self.tree = [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            pass

    def loader_children(self) -> list[int]:
        """Loader children are the forkserver's children (grandchildren of the worker)."""
        found = []
        for child in psutil.Process(self.proc.pid).children():
            found.extend(grandchild.pid for grandchild in child.children())
        return found

    def signal(self, signum: int) -> None:
        self.remember_tree()
        self.proc.send_signal(signum)

    def kill_group(self) -> None:
        self.remember_tree()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill_group()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything the group left behind
        except (ProcessLookupError, PermissionError):
            pass
        return self.proc.returncode

    def leftovers(self) -> list[int]:
        return living(self.tree)


@dataclass
class Chaos:
    """One scenario's world: servers, bucket, model, workers."""

    workdir: Path
    s3: S3Server
    weights: str
    nats_url: str
    s3_url: str
    bucket: str
    workers: list[WorkerProc] = field(default_factory=list)
    env_extra: dict[str, str] = field(default_factory=dict)
    nats: NatsServer | None = None
    cluster: NatsCluster | None = None
    proxy: FlakyS3Proxy | None = None
    replicas: int = 1

    def nats_settings(self) -> NatsSettings:
        return load_settings(
            for_worker=False, nats={"url": self.nats_url, "replicas": self.replicas}
        ).nats

    def start_worker(self) -> WorkerProc:
        settings = load_settings(
            for_worker=False,
            nats={"url": self.nats_url, "replicas": self.replicas},
            s3={"endpoint_url": self.s3_url},
            model={"pipeline": PIPELINE, "weights": self.weights},
        )
        env = worker_env(
            settings,
            **{**CHAOS_BUDGETS, "WORKER_NATS__REPLICAS": str(self.replicas), **self.env_extra},
        )
        proc = WorkerProc(env, self.workdir / f"worker-{len(self.workers)}.log")
        self.workers.append(proc)
        return proc


def upload_job(s3: Any, bucket: str, count: int, bad: bool) -> list[str]:
    uris = []
    for i in range(count):
        key = f"img/{i:04d}.jpg"
        s3.put_object(Bucket=bucket, Key=key, Body=image_bytes(640, 480, seed=i))
        uris.append(f"s3://{bucket}/{key}")
    if bad:
        s3.put_object(Bucket=bucket, Key="bad/corrupt.jpg", Body=corrupt_bytes())
        s3.put_object(Bucket=bucket, Key="bad/truncated.jpg", Body=truncated_bytes())
        uris += [
            f"s3://{bucket}/bad/corrupt.jpg",
            f"s3://{bucket}/bad/truncated.jpg",
            f"s3://{bucket}/bad/missing.jpg",
        ]
    return uris


async def _results_safely(js: Any, settings: NatsSettings, job: str) -> list[dict[str, Any]]:
    try:
        return await job_results(js, settings, job)
    except Exception:  # noqa: BLE001 - the server may be down on purpose
        return []


Inject = Callable[[Chaos, Any], Awaitable[str]]


async def run_job(
    ctx: Chaos,
    fault: str,
    inject: Inject,
    *,
    images: int = 24,
    bad: bool = False,
    workers: int = 1,
    fault_after: int = 4,
) -> Row:
    settings = ctx.nats_settings()
    uris = upload_job(ctx.s3.client(), ctx.bucket, images, bad)
    nc = await connect(settings, name="chaos-client", give_up_after_s=30)
    js = nc.jetstream()
    try:
        await provision(js, settings, PIPELINE)
        for _ in range(workers):
            ctx.start_worker()
        job = f"chaos-{fault}"
        tasks = make_tasks(job, uris)
        await publish_tasks(js, settings, PIPELINE, tasks)
        expected = {t.id for t in tasks}
        deadline = time.monotonic() + JOB_WAIT_S
        results: list[dict[str, Any]] = []
        while len(results) < fault_after and time.monotonic() < deadline:
            results = await _results_safely(js, settings, job)
            await asyncio.sleep(0.1)
        for proc in ctx.workers:
            proc.remember_tree()
        fault_at = time.monotonic()
        note = await inject(ctx, js)
        while time.monotonic() < deadline:
            results = await _results_safely(js, settings, job)
            if expected <= {r["task_id"] for r in results}:
                break
            await asyncio.sleep(0.3)
        recover_s = time.monotonic() - fault_at
        await asyncio.sleep(1.0)  # a late duplicate would show up now
        results = await _results_safely(js, settings, job) or results
    finally:
        await nc.close()
    per_task = Counter(r["task_id"] for r in results)
    return Row(
        fault=fault,
        published=len(expected),
        stored=len(results),
        lost=len(expected - set(per_task)),
        duplicates=sum(n - 1 for n in per_task.values()),
        ok=sum(1 for r in results if r["status"] == "ok"),
        error=sum(1 for r in results if r["status"] == "error"),
        max_attempt=max((r["attempt"] for r in results), default=0),
        recover_s=round(recover_s, 1),
        note=note,
    )


# -- the faults ---------------------------------------------------------------------------------


async def worker_sigkill(ctx: Chaos, _js: Any) -> str:
    ctx.workers[0].kill_group()
    ctx.start_worker()
    return "worker and its loader children SIGKILLed; a fresh worker started"


async def loader_child_sigkill(ctx: Chaos, _js: Any) -> str:
    pid = ctx.workers[0].loader_children()[0]
    os.kill(pid, signal.SIGKILL)
    return f"loader child {pid} SIGKILLed"


async def loader_child_sigstop(ctx: Chaos, _js: Any) -> str:
    pids = ctx.workers[0].loader_children()
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    return f"loader children {pids} SIGSTOPped"


async def nothing(_ctx: Chaos, _js: Any) -> str:
    return "fault set up before the job"


async def s3_errors(ctx: Chaos, _js: Any) -> str:
    assert ctx.proxy is not None
    ctx.proxy.fail_for(1.5)
    await asyncio.sleep(1.5)
    return f"S3 answered 503/500 for 1.5 s ({ctx.proxy.failed} requests)"


async def results_unavailable(ctx: Chaos, js: Any) -> str:
    settings = ctx.nats_settings()
    info = await js.stream_info(settings.results_stream)
    config = info.config
    config.subjects = ["results-paused.>"]
    await js.update_stream(config)
    await asyncio.sleep(4)
    config.subjects = ["results.>"]
    await js.update_stream(config)
    return "results stream refused writes for 4 s"


async def malformed_messages(ctx: Chaos, js: Any) -> str:
    settings = ctx.nats_settings()
    for payload in (b"not json", b"[]", b'{"id": "only-id"}'):
        await js.publish(f"tasks.{PIPELINE}", payload, stream=settings.tasks_stream)
    await asyncio.sleep(3)
    info = await js.stream_info(settings.dead_letter_stream)
    return f"3 malformed messages published; {info.state.messages} on the dead-letter subject"


async def nats_restart(ctx: Chaos, _js: Any) -> str:
    assert ctx.nats is not None
    ctx.nats.stop(remove=False)
    await asyncio.sleep(2)
    ctx.nats.start()
    return "nats-server stopped for 2 s and started again on the same store"


async def cluster_node_killed(ctx: Chaos, _js: Any) -> str:
    assert ctx.cluster is not None
    ctx.cluster.kill_node(0)
    return "node n0 of three SIGKILLed (streams have three replicas)"


async def worker_sigterm(ctx: Chaos, _js: Any) -> str:
    ctx.workers[0].signal(signal.SIGTERM)
    code = await asyncio.to_thread(ctx.workers[0].proc.wait, 30)
    ctx.start_worker()
    return f"SIGTERM: drained and exited {code}; a fresh worker started"


async def one_of_two_killed(ctx: Chaos, _js: Any) -> str:
    ctx.workers[1].kill_group()
    return "second of two workers on the consumer SIGKILLed"


@dataclass(frozen=True)
class Scenario:
    name: str
    inject: Inject
    bad: bool = False
    workers: int = 1
    images: int = 24
    nats: str = "single"  # single | cluster
    s3: str = "direct"  # direct | flaky
    env: dict[str, str] = field(default_factory=dict)


def scenarios(workdir: Path) -> list[Scenario]:
    return [
        Scenario("worker_sigkill_mid_batch", worker_sigkill),
        Scenario("loader_child_sigkill", loader_child_sigkill),
        Scenario("loader_child_sigstop", loader_child_sigstop),
        Scenario(
            "feeder_thread_drops_batch",
            nothing,
            env={"WORKER_FAULTS__DROP_ONCE_FILE": str(workdir / "drop-once")},
        ),
        Scenario("corrupt_truncated_missing", nothing, bad=True),
        Scenario("s3_503_500_burst", s3_errors, s3="flaky"),
        Scenario("results_store_unavailable", results_unavailable),
        Scenario("malformed_messages", malformed_messages),
        Scenario("nats_server_restart", nats_restart),
        Scenario("cluster_node_killed_r3", cluster_node_killed, nats="cluster"),
        Scenario("sigterm_mid_batch", worker_sigterm),
        Scenario("two_workers_one_killed", one_of_two_killed, workers=2, images=96),
    ]


async def run_scenario(
    scenario: Scenario, workdir: Path, s3: S3Server, weights: str
) -> tuple[Row, list[int]]:
    """Run one scenario in a world of its own; returns its row and any processes left over."""
    workdir.mkdir(parents=True, exist_ok=True)
    bucket = f"chaos-{scenario.name.replace('_', '-')}"[:60]
    s3.client().create_bucket(Bucket=bucket)
    nats = cluster = proxy = None
    if scenario.nats == "cluster":
        cluster = NatsCluster().start()
        url = cluster.url
    else:
        nats = NatsServer(store_dir=str(workdir / "nats")).start()
        url = nats.url
    if scenario.s3 == "flaky":
        proxy = FlakyS3Proxy(s3.port).start()
    ctx = Chaos(
        workdir,
        s3,
        weights,
        url,
        proxy.endpoint_url if proxy else s3.endpoint_url,
        bucket,
        env_extra=dict(scenario.env),
        nats=nats,
        cluster=cluster,
        proxy=proxy,
        replicas=3 if cluster else 1,
    )
    try:
        if cluster is not None:
            await _wait_jetstream(ctx)
        row = await run_job(
            ctx,
            scenario.name,
            scenario.inject,
            images=scenario.images,
            bad=scenario.bad,
            workers=scenario.workers,
        )
    finally:
        for proc in ctx.workers:
            proc.stop()
        await asyncio.sleep(0.5)
        left = [pid for proc in ctx.workers for pid in proc.leftovers()]
        if proxy is not None:
            proxy.stop()
        if cluster is not None:
            cluster.stop()
        if nats is not None:
            nats.stop()
    return row, left


async def _wait_jetstream(ctx: Chaos) -> None:
    """A new cluster needs a moment to elect its JetStream meta leader."""
    deadline = time.monotonic() + 30
    while True:
        try:
            nc = await connect(ctx.nats_settings(), name="chaos-probe", give_up_after_s=10)
            try:
                await nc.jetstream().account_info()
                return
            finally:
                await nc.close()
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


def table(rows: list[Row]) -> str:
    head = (
        f"{'fault':<28} {'published':>9} {'stored':>6} {'ok':>4} {'error':>5} {'lost':>4} "
        f"{'dup':>3} {'max_att':>7} {'recover_s':>9}  note"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.fault:<28} {r.published:>9} {r.stored:>6} {r.ok:>4} {r.error:>5} {r.lost:>4} "
            f"{r.duplicates:>3} {r.max_attempt:>7} {r.recover_s:>9}  {r.note}"
        )
    return "\n".join(lines)
