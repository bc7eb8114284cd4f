"""The chaos suite: each fault injected mid-job against real servers, then counted.

For every scenario: tasks published, results stored, lost (must be 0), tasks completed twice
(must be 0: the workers count each result they found already stored, since the results stream
keeps one per task whatever happens), the highest delivery count, the time from the fault
until the job was whole, and whether the fault's own evidence was seen (a scenario whose fault
did not happen proves nothing).
``python -m tests.chaos`` runs them all and prints the table; ``tests/chaos/test_chaos.py`` runs
the same scenarios under pytest (CI).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import nats
import psutil

from config.settings import NatsSettings, load_settings
from tests.chaos.servers import FlakyS3Proxy, NatsCluster
from tests.helpers import until_gone, worker_env
from worker.commands.demo_images import corrupt_bytes, image_bytes, truncated_bytes
from worker.commands.job_client import job_results, make_tasks, publish_tasks
from worker.commands.localservers import NatsServer, S3Server
from worker.nats.connection import connect
from worker.nats.provision import provision

PIPELINE = "mobilenet-v3-small-classifier"
JOB_WAIT_S = 120.0
# Every S3 request of a worker is this late, one read at a time per loader child: a job of 24
# images lasts seconds however fast the model is, so each fault lands mid-job (without it the
# whole job could be done before the fault, and the fault would prove nothing).
S3_DELAY_S = 0.25


@dataclass
class Row:
    fault: str
    published: int
    stored: int
    lost: int
    duplicates: int  # tasks completed a second time (see module docstring)
    ok: int
    error: int
    max_attempt: int
    recover_s: float
    note: str = ""
    unshown: list[str] = field(default_factory=list)  # the fault's evidence not seen

    @property
    def passed(self) -> bool:
        return self.lost == 0 and self.duplicates == 0 and not self.unshown


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
    "WORKER_LOADER__READS_PER_WORKER": "1",
    "WORKER_HEALTH__STALL_TIMEOUT_S": "5",
    "WORKER_HEALTH__WARM_PASS": "false",  # tight budgets: no warm pass
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

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def events(self, event: str) -> list[str]:
        """This worker's JSON log lines of ``event``."""
        return [line for line in self.log().splitlines() if f'"event": "{event}"' in line]


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
    facts: dict[str, Any] = field(default_factory=dict)  # what a fault saw as it was injected
    worker_nats_url: str = ""  # the workers' WORKER_NATS__URL, when not ``nats_url``

    def nats_settings(self) -> NatsSettings:
        return load_settings(
            for_worker=False, nats={"url": self.nats_url, "replicas": self.replicas}
        ).nats

    def start_worker(self) -> WorkerProc:
        settings = load_settings(
            for_worker=False,
            nats={"url": self.worker_nats_url or self.nats_url, "replicas": self.replicas},
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
# After the job: what of the fault's evidence was not seen ([] when all of it was).
Shows = Callable[[Chaos, Any, list[dict[str, Any]]], Awaitable[list[str]]]


async def run_job(
    ctx: Chaos,
    fault: str,
    inject: Inject,
    shows: Shows,
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
        results = await _results_safely(js, settings, job) or results
        unshown = await shows(ctx, js, results)
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
        unshown=unshown,
    )


# -- the faults, and the evidence that each happened -----------------------------------------
# Each fault comes with what shows it happened; a fault that did not happen proves nothing.

EVIDENCE_WAIT_S = 30.0


def _missing(what: str, seen: bool) -> list[str]:
    return [] if seen else [what]


async def worker_sigkill(ctx: Chaos, _js: Any) -> str:
    ctx.workers[0].kill_group()
    ctx.start_worker()
    return "worker and its loader children SIGKILLed; a fresh worker started"


async def worker_sigkill_shown(ctx: Chaos, _js: Any, results: list[dict[str, Any]]) -> list[str]:
    killed = ctx.workers[0].proc.returncode == -signal.SIGKILL
    return _missing("the first worker died of SIGKILL", killed) + _missing(
        "a task it held was delivered again", any(r["attempt"] >= 2 for r in results)
    )


async def loader_child_sigkill(ctx: Chaos, _js: Any) -> str:
    pid = ctx.workers[0].loader_children()[0]
    os.kill(pid, signal.SIGKILL)
    return f"loader child {pid} SIGKILLed"


async def loader_child_sigstop(ctx: Chaos, _js: Any) -> str:
    pids = ctx.workers[0].loader_children()
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    return f"loader children {pids} SIGSTOPped"


async def loader_rebuilt(ctx: Chaos, _js: Any, _results: list[dict[str, Any]]) -> list[str]:
    rebuilt = ctx.workers[0].events("loader_restarted")
    return _missing("the worker rebuilt its loader (loader_restarted)", bool(rebuilt))


async def nothing(_ctx: Chaos, _js: Any) -> str:
    return "fault set up before the job"


async def feeder_drop_shown(ctx: Chaos, _js: Any, results: list[dict[str, Any]]) -> list[str]:
    fired = Path(ctx.env_extra["WORKER_FAULTS__DROP_ONCE_FILE"]).exists()
    timed_out = [line for line in ctx.workers[0].events("loader_restarted") if "timed out" in line]
    return (
        _missing("the fault hook fired (its file exists)", fired)
        + _missing("the loader timed out and was rebuilt", bool(timed_out))
        + _missing("the dropped task was given back", any(r["attempt"] >= 2 for r in results))
    )


async def bad_images_shown(_ctx: Chaos, _js: Any, results: list[dict[str, Any]]) -> list[str]:
    kinds = sorted(r["error"]["type"] for r in results if r["status"] == "error")
    expected = ["corrupt_image", "corrupt_image", "object_missing"]
    return _missing(f"error results {expected} (saw {kinds})", kinds == expected)


async def s3_errors(ctx: Chaos, _js: Any) -> str:
    assert ctx.proxy is not None
    ctx.proxy.fail_for(1.5)
    await asyncio.sleep(1.5)  # the length of the burst
    return f"S3 answered 503/500 for 1.5 s ({ctx.proxy.failed} requests)"


async def s3_errors_shown(ctx: Chaos, _js: Any, _results: list[dict[str, Any]]) -> list[str]:
    assert ctx.proxy is not None
    return _missing("the worker's S3 requests were answered 503/500", ctx.proxy.failed > 0)


async def results_unavailable(ctx: Chaos, js: Any) -> str:
    settings = ctx.nats_settings()
    info = await js.stream_info(settings.results_stream)
    config = info.config
    config.subjects = ["results-paused.>"]
    await js.update_stream(config)
    try:
        await js.publish("results.chaos-probe.t", b"{}", timeout=1)
        ctx.facts["probe_refused"] = False
    except (nats.errors.Error, TimeoutError):
        ctx.facts["probe_refused"] = True
    await asyncio.sleep(4)  # the length of the outage
    config.subjects = ["results.>"]
    await js.update_stream(config)
    return "results stream refused writes for 4 s"


async def results_unavailable_shown(
    ctx: Chaos, _js: Any, _results: list[dict[str, Any]]
) -> list[str]:
    refused = ctx.facts.get("probe_refused") is True
    return _missing("a result written during the outage was refused", refused)


MALFORMED = (b"not json", b"[]", b'{"id": "only-id"}')


async def malformed_messages(ctx: Chaos, js: Any) -> str:
    settings = ctx.nats_settings()
    seqs = []
    for payload in MALFORMED:
        ack = await js.publish(f"tasks.{PIPELINE}", payload, stream=settings.tasks_stream)
        seqs.append(ack.seq)
    ctx.facts["malformed_seqs"] = seqs
    return f"{len(MALFORMED)} malformed messages published (stream sequences {seqs})"


async def dead_letters_shown(ctx: Chaos, js: Any, _results: list[dict[str, Any]]) -> list[str]:
    settings = ctx.nats_settings()
    wanted = set(ctx.facts["malformed_seqs"])
    deadline = time.monotonic() + EVIDENCE_WAIT_S
    kept: set[int] = set()
    while not wanted <= kept and time.monotonic() < deadline:
        info = await js.stream_info(settings.dead_letter_stream)
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            if seq:
                msg = await js.get_msg(settings.dead_letter_stream, seq)
                kept.add(int((msg.headers or {}).get("Worker-Original-Sequence", 0)))
        if not wanted <= kept:
            await asyncio.sleep(0.3)
    return _missing(f"a dead letter for each of sequences {sorted(wanted)}", wanted <= kept)


async def nats_restart(ctx: Chaos, _js: Any) -> str:
    assert ctx.nats is not None
    ctx.nats.stop(remove=False)
    await asyncio.sleep(2)  # the length of the outage
    ctx.nats.start()
    return "nats-server stopped for 2 s and started again on the same store"


async def reconnected_shown(ctx: Chaos, _js: Any, _results: list[dict[str, Any]]) -> list[str]:
    worker = ctx.workers[0]
    return _missing(
        "the worker lost its connection and reconnected",
        bool(worker.events("nats_disconnected")) and bool(worker.events("nats_reconnected")),
    )


async def cluster_node_killed(ctx: Chaos, _js: Any) -> str:
    assert ctx.cluster is not None
    node = ctx.cluster.procs[0]
    ctx.cluster.kill_node(0)
    ctx.facts["node_exit"] = node.returncode if node is not None else None
    return "node n0 of three SIGKILLed (streams have three replicas)"


async def node_killed_shown(ctx: Chaos, _js: Any, _results: list[dict[str, Any]]) -> list[str]:
    killed = ctx.facts.get("node_exit") == -signal.SIGKILL
    return _missing("node n0 died of SIGKILL mid-job", killed)


# The frozen node's scenario runs at the default NATS ping, store-retry and publish settings
# (what is measured is the default's detection), with room for them: a stall and watchdog
# longer than the detection, and an ack wait longer than the store retry. The messages a
# pull request had on their way through the frozen node are redelivered after the ack wait.
FROZEN_ENV = {
    "WORKER_NATS__PUBLISH_TIMEOUT_S": "5",
    "WORKER_NATS__STORE_RETRY_S": "30",
    "WORKER_NATS__ACK_WAIT_S": "45",
    "WORKER_HEALTH__STALL_TIMEOUT_S": "20",
    "WORKER_HEALTH__WATCHDOG_TIMEOUT_S": "40",
}
STORES_AGAIN_WITHIN_S = 30.0


def _log_time(line: str) -> float:
    """The Unix time of a JSON log line of the worker."""
    return datetime.fromisoformat(json.loads(line)["timestamp"]).timestamp()


def _first_after(lines: list[str], since: float) -> float | None:
    """Seconds from ``since`` (Unix time) to the first of ``lines`` at or after it."""
    times = [t - since for t in map(_log_time, lines) if t >= since]
    return round(min(times), 1) if times else None


async def cluster_node_frozen(ctx: Chaos, _js: Any) -> str:
    """SIGSTOP the node the worker is connected to (its only configured URL; it learned the
    others from the cluster); the node stays frozen until the cluster stops (``stop`` thaws
    it, in the scenario's ``finally``)."""
    assert ctx.cluster is not None
    worker = ctx.workers[0]
    ctx.facts["frozen_at"] = frozen_at = time.time()
    ctx.facts["frozen_pid"] = ctx.cluster.freeze_node(0)
    deadline = time.monotonic() + 2 * STORES_AGAIN_WITHIN_S
    while time.monotonic() < deadline:  # read from its log file: no event to wait on
        if worker.events("nats_reconnected"):
            break
        await asyncio.sleep(0.5)
    noticed_s = _first_after(worker.events("nats_disconnected"), frozen_at)
    moved_s = _first_after(worker.events("nats_reconnected"), frozen_at)
    return (
        f"node n0 of three SIGSTOPped (sockets open); its worker noticed after {noticed_s} s, "
        f"reconnected after {moved_s} s"
    )


async def node_frozen_shown(ctx: Chaos, _js: Any, _results: list[dict[str, Any]]) -> list[str]:
    assert ctx.cluster is not None
    worker, frozen_at = ctx.workers[0], ctx.facts["frozen_at"]
    try:
        frozen = psutil.Process(ctx.facts["frozen_pid"]).status() == psutil.STATUS_STOPPED
    except psutil.NoSuchProcess:
        frozen = False
    n0 = f":{ctx.cluster.ports[0]}"
    moved = [line for line in worker.events("nats_reconnected") if n0 not in line]
    stored_s = _first_after(worker.events("task_done"), frozen_at)
    given_back = [line for line in worker.events("task_retried") if "results stream" in line]
    return (
        _missing("node n0 stayed frozen (SIGSTOP) to the end of the job", frozen)
        + _missing("the worker reconnected to another node", bool(moved))
        + _missing(
            f"the worker stored results again within {STORES_AGAIN_WITHIN_S:g} s of the freeze "
            f"(first after {stored_s} s)",
            stored_s is not None and stored_s <= STORES_AGAIN_WITHIN_S,
        )
        + _missing(
            "no result was given back for the results stream (each stored on the new "
            f"connection; {len(given_back)} given back)",
            not given_back,
        )
        + _missing(
            "the same worker process served throughout",
            len(ctx.workers) == 1 and worker.proc.poll() is None,
        )
    )


async def worker_sigterm(ctx: Chaos, _js: Any) -> str:
    ctx.facts["done_before_signal"] = len(ctx.workers[0].events("task_done"))
    ctx.workers[0].signal(signal.SIGTERM)
    code = await asyncio.to_thread(ctx.workers[0].proc.wait, 30)
    ctx.start_worker()
    return f"SIGTERM: drained and exited {code}; a fresh worker started"


async def drained_shown(ctx: Chaos, _js: Any, _results: list[dict[str, Any]]) -> list[str]:
    first = ctx.workers[0]
    finished = len(first.events("task_done")) > ctx.facts["done_before_signal"]
    gave_back = bool(first.events("tasks_given_back"))
    return _missing("the signalled worker drained and exited 0", first.proc.returncode == 0) + (
        _missing(
            "it held work: finished its batches in hand or gave tasks back", finished or gave_back
        )
    )


async def one_of_two_killed(ctx: Chaos, _js: Any) -> str:
    ctx.workers[1].kill_group()
    return "second of two workers on the consumer SIGKILLed"


async def second_killed_shown(ctx: Chaos, _js: Any, _results: list[dict[str, Any]]) -> list[str]:
    killed = ctx.workers[1].proc.returncode == -signal.SIGKILL
    return _missing("the second worker died of SIGKILL", killed)


@dataclass(frozen=True)
class Scenario:
    name: str
    inject: Inject
    shows: Shows
    bad: bool = False
    workers: int = 1
    images: int = 24
    # single | cluster | cluster_first (workers given node n0's URL only, the suite's own
    # client the other two)
    nats: str = "single"
    env: dict[str, str] = field(default_factory=dict)


def scenarios(workdir: Path) -> list[Scenario]:
    return [
        Scenario("worker_sigkill_mid_batch", worker_sigkill, worker_sigkill_shown),
        Scenario("loader_child_sigkill", loader_child_sigkill, loader_rebuilt),
        Scenario("loader_child_sigstop", loader_child_sigstop, loader_rebuilt),
        Scenario(
            "feeder_thread_drops_batch",
            nothing,
            feeder_drop_shown,
            env={"WORKER_FAULTS__DROP_ONCE_FILE": str(workdir / "drop-once")},
        ),
        Scenario("corrupt_truncated_missing", nothing, bad_images_shown, bad=True),
        Scenario("s3_503_500_burst", s3_errors, s3_errors_shown),
        Scenario("results_store_unavailable", results_unavailable, results_unavailable_shown),
        Scenario("malformed_messages", malformed_messages, dead_letters_shown),
        Scenario("nats_server_restart", nats_restart, reconnected_shown),
        Scenario("cluster_node_killed_r3", cluster_node_killed, node_killed_shown, nats="cluster"),
        Scenario(
            "cluster_node_frozen_r3",
            cluster_node_frozen,
            node_frozen_shown,
            images=96,
            nats="cluster_first",
            env=FROZEN_ENV,
        ),
        Scenario("sigterm_mid_batch", worker_sigterm, drained_shown),
        Scenario(
            "two_workers_one_killed", one_of_two_killed, second_killed_shown, workers=2, images=96
        ),
    ]


async def run_scenario(
    scenario: Scenario, workdir: Path, s3: S3Server, weights: str
) -> tuple[Row, list[int]]:
    """Run one scenario in a world of its own; returns its row and any processes left over."""
    workdir.mkdir(parents=True, exist_ok=True)
    bucket = f"chaos-{scenario.name.replace('_', '-')}"[:60]
    s3.client().create_bucket(Bucket=bucket)
    nats = cluster = None
    worker_url = ""
    if scenario.nats.startswith("cluster"):
        cluster = NatsCluster().start()
        url = cluster.url
        if scenario.nats == "cluster_first":
            url, worker_url = cluster.urls(1, 2), cluster.urls(0)
    else:
        nats = NatsServer(store_dir=str(workdir / "nats")).start()
        url = nats.url
    proxy = FlakyS3Proxy(s3.port, delay_s=S3_DELAY_S).start()
    ctx = Chaos(
        workdir,
        s3,
        weights,
        url,
        proxy.endpoint_url,
        bucket,
        env_extra=dict(scenario.env),
        nats=nats,
        cluster=cluster,
        proxy=proxy,
        replicas=3 if cluster else 1,
        worker_nats_url=worker_url,
    )
    try:
        if cluster is not None:
            await _wait_jetstream(ctx)
        row = await run_job(
            ctx,
            scenario.name,
            scenario.inject,
            scenario.shows,
            images=scenario.images,
            bad=scenario.bad,
            workers=scenario.workers,
        )
    finally:
        for proc in ctx.workers:
            proc.stop()
        tree = [pid for proc in ctx.workers for pid in proc.tree]
        left = await asyncio.to_thread(until_gone, tree, 10.0)  # children reaped a moment late
        # Every worker has ended: its log is whole. A second completion of a task is a
        # result it found already stored (the stream refuses a second one, so the results
        # alone cannot show it).
        twice = sum(len(proc.events("result_already_stored")) for proc in ctx.workers)
        proxy.stop()
        if cluster is not None:
            cluster.stop()
        if nats is not None:
            nats.stop()
    row.duplicates += twice
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
        if r.unshown:
            lines.append(f"{'':<28} NOT SHOWN: {'; '.join(r.unshown)}")
    return "\n".join(lines)
