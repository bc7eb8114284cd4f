"""10,000 one-task jobs through one worker (fair share on, one subject each, as Antenna
publishes): tasks/s, the job consumers made and deleted, the most consumers on the tasks
stream at once, and the worker's RSS before and after. Every result is checked (``ok``).

    .venv/bin/python -m bench.many_jobs --jobs 10000
    .venv/bin/python -m bench.many_jobs --smoke     # outcomes only (the test suite runs it)
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.common.job_runs import client, wait_stored
from bench.common.records import save, stamp
from bench.common.sampling import sampled
from bench.common.world import PIPELINE, nats_settings, start_worker, stop_worker, upload, world
from bench.outcomes import BenchmarkFailed, refusing
from config.settings import NatsSettings
from worker.commands.job_client import make_tasks, publish_tasks
from worker.commands.localservers import free_port

WAVE = 500
CONSUMERS = "inference_worker_job_consumers"


def say(line: str) -> None:
    """Progress on stderr, so a run that stops somewhere says where."""
    print(f"many_jobs: {line}", file=sys.stderr, flush=True)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        for line in answer.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return float("nan")


async def wait_port_answers(
    port: int, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 240
) -> None:
    """Until the worker answers on ``port``; a worker that exited, or never answered within
    ``timeout_s`` (a start on a machine the test suite keeps busy), fails the run with its
    log's end."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchmarkFailed(f"the worker exited {proc.returncode}: {log_tail(log)}")
        try:
            if metric(port, "inference_worker_job_consumers_made_total") == 0:
                return  # started: the job consumers' metrics are there
        except OSError:
            pass
        await asyncio.sleep(0.2)
    raise BenchmarkFailed(f"the worker never answered in {timeout_s:.0f} s: {log_tail(log)}")


def log_tail(log: Path, most_bytes: int = 3000) -> str:
    try:
        return log.read_bytes()[-most_bytes:].decode(errors="replace")
    except OSError as error:
        return f"(its log unread: {error})"


async def flood(
    js: Any, settings: NatsSettings, uris: list[str], jobs: int
) -> tuple[float, list[int]]:
    """``jobs`` one-task jobs in waves of ``WAVE``, at most two waves ahead of the stored
    results: seconds until every result was stored, and the tasks stream's consumer counts
    sampled every 0.1 s meanwhile."""

    async def consumers() -> int:
        return int((await js.stream_info(settings.tasks_stream)).state.consumer_count)

    async with sampled(consumers, every_s=0.1) as seen:  # stopped, not cancelled: see there
        started = time.monotonic()
        # 10,000 jobs take about 4 minutes here: ten times the rate's time, two minutes at least.
        deadline = started + max(120.0, jobs * 0.25)
        for wave in range(0, jobs, WAVE):
            tasks = [
                t
                for j in range(wave, min(jobs, wave + WAVE))
                for t in make_tasks(f"many-{j}", [uris[j % len(uris)]])
            ]
            await publish_tasks(js, settings, PIPELINE, tasks)
            await wait_stored(js, settings.results_stream, wave - WAVE, deadline, poll_s=0.1)
        await wait_stored(js, settings.results_stream, jobs, deadline, poll_s=0.1)
    return time.monotonic() - started, seen


def dump_tasks_on_sigusr1() -> None:
    """``kill -USR1 <pid>``: every asyncio task's stack on stderr (a run that stalls shows
    what it awaits; faulthandler shows only the event loop's select)."""

    def dump() -> None:
        for task in asyncio.all_tasks():
            task.print_stack(file=sys.stderr)
        sys.stderr.flush()

    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump)


async def run(jobs: int, smoke: bool) -> dict[str, Any]:
    dump_tasks_on_sigusr1()
    with world() as w:
        uris = upload(w.s3.client(), "many", [(64, 48)], 8)
        port = free_port()
        # a smoke run's log at INFO, so a start that fails says where; a timed run's at the
        # level its baseline was taken at (BENCH_LOG_LEVEL, WARNING by default)
        level = {"WORKER_LOG_LEVEL": "INFO"} if smoke else {}
        proc = start_worker(w, "worker.log", WORKER_METRICS__PORT=str(port), **level)
        settings = nats_settings(w)
        try:
            async with client(settings, PIPELINE) as nc:
                js = nc.jetstream()
                await wait_port_answers(port, proc, w.workdir / "worker.log")
                say(f"worker {proc.pid} answers on port {port}; publishing {jobs} jobs")
                rss_before = rss_bytes(proc.pid)
                seconds, seen = await flood(js, settings, uris, jobs)
                say(f"{jobs} results stored in {seconds:.1f}s; waiting out the consumers' linger")
                ok = metric(
                    port, f'inference_worker_tasks_total{{outcome="ok",pipeline="{PIPELINE}"}}'
                )
                if ok != jobs:
                    raise BenchmarkFailed(f"{ok} ok results of {jobs}")
                await asyncio.sleep(10)  # the last consumers' linger
                after = int((await js.stream_info(settings.tasks_stream)).state.consumer_count)
            return {
                "jobs": jobs,
                "tasks_per_s": round(jobs / seconds, 1),
                "seconds": round(seconds, 1),
                **{
                    f"consumers_{what}": metric(port, f"{CONSUMERS}_{what}_total")
                    for what in ("made", "deleted", "refused")
                },
                "most_consumers_at_once": max(seen),
                "consumers_after": after,
                "rss_before_bytes": rss_before,
                "rss_after_bytes": rss_bytes(proc.pid),
            }
        finally:
            stop_worker(proc)


@refusing
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--smoke", action="store_true", help="20 jobs: outcomes only")
    args = parser.parse_args()
    if args.smoke:
        args.jobs = 20
    result = asyncio.run(run(args.jobs, args.smoke))
    result.update(stamp("many_jobs"))
    save("many_jobs", result, echo=True)


if __name__ == "__main__":
    main()
