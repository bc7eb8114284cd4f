"""A new job's path at the feed alone, fair share on: one-task jobs published 0.1 s apart to a
``TaskFeed`` on a local nats-server, each timed from its publish to the fetch that returns its
task, with every NATS request on the way timed (issue 32: where a new job's overhead goes).

    .venv/bin/python -m bench.new_job [--jobs 20] [--detail]

Each job must be fetched within 1.5 s (else ``BenchmarkFailed``) before a figure is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Callable
from typing import Any

from nats.js import JetStreamContext
from nats.js.manager import JetStreamManager

from bench.common.meters import median
from bench.common.world import PIPELINE
from bench.outcomes import BenchmarkFailed
from config.settings import load_settings
from worker.commands.client import make_tasks, publish_tasks
from worker.commands.localservers import NatsServer
from worker.nats.connection import connect
from worker.nats.feed import TaskFeed
from worker.nats.provision import provision

Event = tuple[str, float, float]  # what, started (ms after the publish began), took (ms)


def timed(events: list[Event], since: Callable[[], float]) -> None:
    """Every request on a new job's path, timed into ``events`` (this process only)."""
    for cls, name in [
        (JetStreamManager, "consumer_info"),
        (JetStreamManager, "add_consumer"),
        (JetStreamManager, "consumers_info"),
        (JetStreamContext, "pull_subscribe_bind"),
        (JetStreamContext.PullSubscription, "fetch"),
    ]:
        original = getattr(cls, name)

        async def wrapper(*a: Any, _o: Any = original, _n: str = name, **k: Any) -> Any:
            started = time.perf_counter()
            try:
                return await _o(*a, **k)
            finally:
                events.append((_n, since() * 1e3, (time.perf_counter() - started) * 1e3))

        setattr(cls, name, wrapper)


async def fetching(feed: TaskFeed, got: dict[str, float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        for msg in await feed.fetch(16):
            got.setdefault(msg.subject, time.perf_counter())
            await msg.ack()


async def one_job(js: Any, settings: Any, got: dict[str, float], began: list[float]) -> float:
    job = f"new-{time.time_ns()}"
    began[0] = time.perf_counter()
    await publish_tasks(js, settings, PIPELINE, make_tasks(job, ["s3://b/x.jpg"]))
    for _ in range(300):
        subject = next((s for s in got if s.endswith(job)), None)
        if subject is not None:
            return (got[subject] - began[0]) * 1e3
        await asyncio.sleep(0.005)
    raise BenchmarkFailed(f"job {job} was not fetched within 1.5 s")


async def run(jobs: int, detail: bool) -> None:
    server = NatsServer(store_dir=tempfile.mkdtemp(prefix="iw-new-job-") + "/nats").start()
    events: list[Event] = []
    began = [0.0]
    timed(events, lambda: time.perf_counter() - began[0])
    try:
        settings = load_settings(for_worker=False, nats={"url": server.url}).nats
        nc, feed_nc = await connect(settings), await connect(settings)
        js = nc.jetstream()
        await provision(js, settings, PIPELINE)
        feed = TaskFeed(feed_nc, settings, [PIPELINE])
        await feed.open()
        got: dict[str, float] = {}
        stop = asyncio.Event()
        loop = asyncio.create_task(fetching(feed, got, stop))
        await asyncio.sleep(1.0)
        fetched_ms = []
        for n in range(jobs):
            events.clear()
            fetched_ms.append(await one_job(js, settings, got, began))
            if detail:
                print(f"job {n}: fetched {fetched_ms[-1]:.2f} ms after its publish began")
                for what, at, took in (e for e in events if e[1] < fetched_ms[-1]):
                    print(f"    {what:>20} at {at:7.2f} ms, took {took:6.2f} ms")
            await asyncio.sleep(0.1)
        stop.set()
        await asyncio.wait_for(loop, 5)
        await feed.close()
        await nc.close()
        await feed_nc.close()
        fetched_ms.sort()
        print(
            f"publish -> first fetch, {jobs} jobs: median {median(fetched_ms):.2f} ms, "
            f"min {fetched_ms[0]:.2f}, max {fetched_ms[-1]:.2f}"
        )
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--detail", action="store_true")
    args = parser.parse_args()
    asyncio.run(run(args.jobs, args.detail))


if __name__ == "__main__":
    main()
