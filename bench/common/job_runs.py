"""The one job runner: publish jobs to a running worker, wait for every task's result, and
count what came back.

``run_jobs`` publishes one or more jobs (list order) and records, per job, when each task's
first result message arrived (seconds after the first publish) and every result message seen;
``run_job`` is one job whose results must all be ``ok`` answers, timed from its publish to its
last result. ``wait_stored`` counts the results stream instead, for runs of so many jobs that a
subscription per job would be part of what is measured. ``client`` is the benchmark's own
NATS client of its local server, with the streams provisioned.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common.world import PIPELINE
from bench.outcomes import BenchmarkFailed, Outcomes
from config.settings import NatsSettings
from worker.commands.job_client import make_tasks, publish_tasks
from worker.nats.subjects import job_results_subject


@asynccontextmanager
async def client(settings: NatsSettings, pipelines: str | list[str]) -> AsyncIterator[Any]:
    """A NATS client of the benchmark's local server (nats-py's own ``connect``: a benchmark
    needs none of the worker's reconnect handling), with the streams and the durable consumer
    provisioned for ``pipelines`` as ``inference-worker provision`` makes them; closed after."""
    import nats

    from worker.nats.provision import provision

    nc = await nats.connect(settings.url, name="bench")
    try:
        await provision(nc.jetstream(), settings, pipelines)
        yield nc
    finally:
        await nc.close()


@dataclass
class Job:
    """A job run through a worker: its tasks' URIs, and what came back."""

    name: str
    uris: list[str]
    pipeline: str = PIPELINE
    published_at: float = 0.0  # seconds after the run's first publish
    arrivals: dict[str, float] = field(default_factory=dict)  # result subject -> first seen
    messages: int = 0  # result messages seen (a second one for a task would count here)
    first: dict[str, bytes] = field(default_factory=dict)  # result subject -> first message
    results: list[dict[str, Any]] = field(default_factory=list)  # as stored, when read back

    @property
    def done_at(self) -> float:
        return max(self.arrivals.values())

    @property
    def first_at(self) -> float:
        return min(self.arrivals.values())

    def longest_gap(self, until: float) -> float:
        """Longest time without a result of this job, from its publish to ``until``."""
        marks = [self.published_at, *sorted(t for t in self.arrivals.values() if t < until)]
        return max(b - a for a, b in zip(marks, [*marks[1:], until], strict=True))

    def received(self) -> list[dict[str, Any]]:
        """Each task's first result message, as it came."""
        return [json.loads(data) for data in self.first.values()]


async def run_jobs(
    nc: Any,
    settings: NatsSettings,
    jobs: list[Job],
    *,
    timeout_s: float = 1800.0,
    worker: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
    linger_s: float = 0.0,
) -> list[Job]:
    """Publish ``jobs`` one after the other and wait until every task has a result message;
    ``linger_s`` more, for a second message of a task to be seen. ``BenchmarkFailed`` when
    ``timeout_s`` passes first or ``worker`` exits (naming its ``log``)."""
    js = nc.jetstream()
    all_in: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    started = time.perf_counter()

    def on_result(job: Job) -> Any:
        async def seen(msg: Any) -> None:
            job.messages += 1
            if msg.subject not in job.arrivals:  # one subject per task
                job.arrivals[msg.subject] = time.perf_counter() - started
                job.first[msg.subject] = msg.data
            if all(len(j.arrivals) >= len(j.uris) for j in jobs) and not all_in.done():
                all_in.set_result(None)

        return seen

    subs = [await nc.subscribe(job_results_subject(j.name), cb=on_result(j)) for j in jobs]
    try:
        started = time.perf_counter()
        for job in jobs:
            job.published_at = time.perf_counter() - started
            await publish_tasks(js, settings, job.pipeline, make_tasks(job.name, job.uris))
        await _all_in(all_in, jobs, timeout_s, worker, log)
        if linger_s:
            await asyncio.sleep(linger_s)
    finally:
        for sub in subs:
            await sub.unsubscribe()
    return jobs


async def _all_in(
    all_in: asyncio.Future[None],
    jobs: list[Job],
    timeout_s: float,
    worker: subprocess.Popen[bytes] | None,
    log: Path | None,
) -> None:
    deadline = time.monotonic() + timeout_s
    while not all_in.done():
        exited = worker is not None and worker.poll() is not None
        if exited or time.monotonic() > deadline:
            got = sum(len(j.arrivals) for j in jobs)
            asked = sum(len(j.uris) for j in jobs)
            why = f"the worker exited {worker.returncode}" if worker and exited else "timeout"
            see = f"; see {log}" if log else ""
            raise BenchmarkFailed(f"{got} of {asked} results ({why}){see}")
        await asyncio.wait({all_in}, timeout=0.5)


async def run_job(
    nc: Any, settings: NatsSettings, job: str, uris: list[str], pipeline: str = PIPELINE
) -> float:
    """Seconds from the first publish to the arrival of the job's last result;
    ``BenchmarkFailed`` unless every task's result is ``ok``."""
    (done,) = await run_jobs(nc, settings, [Job(job, uris, pipeline)])
    outcomes = Outcomes(f"worker end to end, job {job}")
    for result in done.received():
        count(outcomes, result)
    outcomes.check(len(uris))
    return done.done_at


def count(outcomes: Outcomes, result: dict[str, Any]) -> None:
    """One stored result counted: ``ok`` with detections in its response (or in the object
    a response too large for a message went to), or the error it carries."""
    response = result.get("response")
    if result.get("status") == "ok" and (
        (response is not None and response.get("detections"))
        or (response is None and result.get("response_object"))
    ):
        outcomes.good()
    elif result.get("status") == "ok":
        outcomes.bad("no_detections", f"an ok result with no detections: {str(result)[:200]}")
    else:
        error = result.get("error") or {}
        outcomes.bad(str(error.get("kind", "not_ok")), str(error.get("message", result))[:300])


async def results_stored(js: Any, stream: str) -> int:
    info = await js.stream_info(stream)
    return int(info.state.messages)


async def wait_stored(
    js: Any, stream: str, at_least: int, deadline: float, poll_s: float = 0.05
) -> None:
    """Until ``stream`` holds ``at_least`` results; ``TimeoutError`` past ``deadline``
    (``time.monotonic()``)."""
    while (stored := await results_stored(js, stream)) < at_least:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{stored} results stored of the {at_least} awaited by the deadline")
        await asyncio.sleep(poll_s)
