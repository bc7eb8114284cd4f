"""What job discovery costs a fleet: N worker processes' task feeds (``TaskFeed``, fair share
on, each with its own NATS connection, as ``inference-worker run`` holds them) against one
real nats-server with M job consumers, idle; then one-task jobs published to them.

Reports the consumer listings a second (every listing is a request on
``$JS.API.CONSUMER.LIST.<stream>``, counted by a subscription there), the bytes a second the
server sends (its /varz ``out_bytes``), the server's CPU (its /proc utime + stime) over a
window after a warm-up, one listing's size, and each new job's first-task latency: publish to
the first fetch, among the N feeds, that returns its task.

The M job consumers stand for jobs whose tasks other processes hold: they exist, with nothing
pending here (``WORKER_NATS__JOB_CONSUMER_LINGER_S`` is set past the run, so the idle feeds do
not delete them). Feeds run in ``--procs`` OS processes, N / procs each.

    .venv/bin/python -m bench.listing --feeds 100 --consumers 200            # after
    .venv/bin/python -m bench.listing --feeds 100 --consumers 200 --idle-s 1  # today's cadence
    .venv/bin/python -m bench.listing --smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import queue
import statistics
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.common.records import save, stamp
from bench.common.world import PIPELINE
from bench.outcomes import BenchmarkFailed, refusing
from config.settings import NatsSettings
from worker.commands.localservers import NatsServer, free_port

JOB_SPACING_S = 2.3  # between the new jobs: not a multiple of any cadence interval
FIRST_TASK_WAIT_S = 60.0


def settings_for(url: str, idle_s: float | None) -> NatsSettings:
    from config.settings import NatsSettings, load_settings

    nats: dict[str, Any] = {"url": url, "job_consumer_linger_s": 1e9}
    if idle_s is not None and "job_discovery_idle_s" in NatsSettings.model_fields:
        nats["job_discovery_idle_s"] = idle_s
    return load_settings(for_worker=False, nats=nats).nats


def server_cpu_s(pid: int) -> float:
    """The process's user + system CPU seconds (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def varz(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/varz", timeout=10) as answer:
        result: dict[str, Any] = json.loads(answer.read())
        return result


async def _feeds(url: str, idle_s: float | None, count: int, fetched: Any, stop: Any) -> None:
    """``count`` feeds, each on its own connection, fetching until ``stop``; each task fetched
    is acked and its job put on ``fetched`` with the time (CLOCK_MONOTONIC: one clock for every
    process of the machine)."""
    from worker.nats.connection import connect
    from worker.nats.feed import TaskFeed

    settings = settings_for(url, idle_s)

    async def one(n: int) -> None:
        nc = await connect(settings, name=f"bench-feed-{n}", give_up_after_s=60)
        feed = TaskFeed(nc, settings, [PIPELINE])
        await feed.open()
        try:
            while not stop.is_set():
                for msg in await feed.fetch(8):
                    fetched.put((json.loads(msg.data)["job_id"], time.monotonic()))
                    await msg.ack()
        finally:
            await feed.close()
            await nc.close()

    await asyncio.gather(*(one(n) for n in range(count)))


def feeds_process(url: str, idle_s: float | None, count: int, fetched: Any, stop: Any) -> None:
    asyncio.run(_feeds(url, idle_s, count, fetched, stop))


class Fleet:
    """The feeds, in ``procs`` processes."""

    def __init__(self, url: str, idle_s: float | None, feeds: int, procs: int) -> None:
        ctx = mp.get_context("spawn")
        self.fetched: Any = ctx.Queue()
        self._stop = ctx.Event()
        shares = [feeds // procs + (i < feeds % procs) for i in range(procs)]
        self._procs = [
            ctx.Process(target=feeds_process, args=(url, idle_s, n, self.fetched, self._stop))
            for n in shares
            if n
        ]

    def start(self) -> None:
        for proc in self._procs:
            proc.start()

    def stop(self) -> None:
        self._stop.set()
        for proc in self._procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join()


async def listing_bytes(nc: Any, stream: str) -> int:
    """One listing's answer, in bytes (its first page)."""
    answer = await nc.request(f"$JS.API.CONSUMER.LIST.{stream}", b'{"offset":0}', timeout=10)
    return len(answer.data)


async def first_tasks(js: Any, settings: NatsSettings, fleet: Fleet, jobs: int) -> list[float]:
    """Seconds from each one-task job's publish to its task's first fetch."""
    from worker.commands.job_client import make_tasks, publish_tasks

    latencies = []
    for j in range(jobs):
        await asyncio.sleep(JOB_SPACING_S)
        job = f"listing-new-{j}"
        (task,) = make_tasks(job, [f"s3://none/{j}.jpg"])
        published = time.monotonic()
        await publish_tasks(js, settings, PIPELINE, [task])
        deadline = published + FIRST_TASK_WAIT_S
        while (at := fetched_at(fleet, job)) is None:
            if time.monotonic() > deadline:
                raise BenchmarkFailed(f"{job}'s task not fetched in {FIRST_TASK_WAIT_S} s")
            await asyncio.sleep(0)
        latencies.append(at - published)
    return latencies


def fetched_at(fleet: Fleet, job: str) -> float | None:
    """When ``job``'s task was fetched, if it was by now (others' fetches dropped)."""
    try:
        got, at = fleet.fetched.get(timeout=0.01)
    except queue.Empty:
        return None
    return float(at) if got == job else None


def snapshot(server: NatsServer, listed: list[float]) -> tuple[float, dict[str, Any], int, float]:
    """The server's CPU seconds, its /varz, the listings counted, and the time."""
    assert server.proc is not None
    return server_cpu_s(server.proc.pid), varz(server.http_port), len(listed), time.monotonic()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import nats

    from worker.nats.provision import provision

    try:
        from worker.nats.provision import job_consumer_config
    except ImportError:  # the tree before the settings slices (f87017c, the baseline's run)
        from worker.nats.job_names import job_consumer_config  # type: ignore[attr-defined,no-redef]

    server = NatsServer(http_port=free_port()).start()
    fleet: Fleet | None = None
    try:
        settings = settings_for(server.url, args.idle_s)
        nc = await nats.connect(server.url, name="bench-listing")
        js = nc.jetstream()
        await provision(js, settings, PIPELINE)
        for j in range(args.consumers):
            subject = f"tasks.{PIPELINE}.held-elsewhere-{j}"
            await js.add_consumer(
                settings.tasks_stream, config=job_consumer_config(settings, subject)
            )
        one_listing = await listing_bytes(nc, settings.tasks_stream)
        listed: list[float] = []

        async def count(_msg: Any) -> None:
            listed.append(time.monotonic())

        await nc.subscribe(f"$JS.API.CONSUMER.LIST.{settings.tasks_stream}", cb=count)
        fleet = Fleet(server.url, args.idle_s, args.feeds, args.procs)
        fleet.start()
        await asyncio.sleep(args.warmup_s)
        cpu0, v0, n0, t0 = snapshot(server, listed)
        await asyncio.sleep(args.window_s)
        cpu1, v1, n1, t1 = snapshot(server, listed)
        latencies = await first_tasks(js, settings, fleet, args.jobs)
        await nc.close()
    finally:
        if fleet is not None:
            fleet.stop()
        server.stop()
    window = {"seconds": t1 - t0, "listings": n1 - n0, "cpu_s": cpu1 - cpu0}
    return summary(args, settings, window, (v0, v1), one_listing, latencies)


def summary(
    args: argparse.Namespace,
    settings: NatsSettings,
    window: dict[str, float],
    varzs: tuple[dict[str, Any], dict[str, Any]],
    one_listing: int,
    latencies: list[float],
) -> dict[str, Any]:
    """The figures of one run, as saved."""
    seconds, (v0, v1) = window["seconds"], varzs
    ordered = sorted(latencies)
    return {
        "feeds": args.feeds,
        "job_consumers": args.consumers,
        "job_discovery_s": settings.job_discovery_s,
        "job_discovery_idle_s": getattr(settings, "job_discovery_idle_s", "absent (today's code)"),
        "window_s": round(seconds, 1),
        "listings_per_s": round(window["listings"] / seconds, 2),
        "server_out_bytes_per_s": round((v1["out_bytes"] - v0["out_bytes"]) / seconds),
        "server_in_msgs_per_s": round((v1["in_msgs"] - v0["in_msgs"]) / seconds, 1),
        "server_cpu_cores": round(window["cpu_s"] / seconds, 3),
        "one_listing_bytes": one_listing,
        "first_task_s": {
            "median": round(statistics.median(ordered), 4),
            "p90": round(ordered[math.ceil(0.9 * len(ordered)) - 1], 4),  # nearest rank
            "max": round(ordered[-1], 4),
            "each": [round(x, 4) for x in latencies],
        },
    }


@refusing
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--feeds", type=int, default=100, help="worker processes' feeds")
    parser.add_argument("--consumers", type=int, default=200, help="job consumers that exist")
    parser.add_argument("--procs", type=int, default=4, help="OS processes the feeds run in")
    parser.add_argument("--idle-s", type=float, default=None, help="JOB_DISCOVERY_IDLE_S")
    parser.add_argument("--warmup-s", type=float, default=20.0)
    parser.add_argument("--window-s", type=float, default=30.0)
    parser.add_argument("--jobs", type=int, default=10, help="new one-task jobs, then")
    parser.add_argument("--name", default="listing", help="results file name")
    parser.add_argument("--smoke", action="store_true", help="4 feeds, 20 consumers: outcomes")
    args = parser.parse_args()
    if args.smoke:
        args.feeds, args.consumers, args.procs = 4, 20, 1
        args.warmup_s, args.window_s, args.jobs = 2.0, 3.0, 2
    result = asyncio.run(run(args))
    result.update(stamp("listing"))
    save(args.name, result, echo=True)


if __name__ == "__main__":
    main()
