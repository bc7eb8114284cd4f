"""Leak soak: 10,000 tasks through one worker, sampling its whole process tree every 1,000.

    .venv/bin/python -m bench.soak [--tasks 10000] [--every 1000] [--batch-size 8]

Samples: resident memory of the main process and of each loader child, open descriptors of
every process in the tree, bytes of /dev/shm the tree holds, entries in /dev/shm, and the
loader child pids; every task's result is checked (all ``ok``). The goal is flat:
descriptors and /dev/shm entries do not grow, pids do not change, and resident memory grows
less than 1 MB per 1,000 batches after warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from typing import Any

import psutil

from bench.common.job_runs import Job, client, count, run_jobs
from bench.common.records import save
from bench.common.world import (
    PIPELINE,
    World,
    nats_settings,
    start_worker,
    stop_worker,
    upload,
    world,
)
from bench.outcomes import Outcomes, refusing
from worker.health.procstats import shm_bytes


def sample(worker_pid: int, done: int, started: float) -> dict[str, Any]:
    root = psutil.Process(worker_pid)
    forkserver_children = [c for c in root.children() if c.children()]
    loaders = [g for c in forkserver_children for g in c.children()]
    tree = [root, *root.children(recursive=True)]
    seen: set[int] = set()
    return {
        "tasks_done": done,
        "elapsed_s": round(time.monotonic() - started, 1),
        "main_rss_mb": round(root.memory_info().rss / 2**20, 1),
        "loader_rss_mb": [round(p.memory_info().rss / 2**20, 1) for p in loaders],
        "loader_pids": sorted(p.pid for p in loaders),
        "fds": {f"{p.pid}:{'main' if p.pid == worker_pid else 'child'}": p.num_fds() for p in tree},
        "fds_total": sum(p.num_fds() for p in tree),
        "shm_bytes": sum(shm_bytes(p.pid, seen) for p in tree),
        "dev_shm_entries": len(os.listdir("/dev/shm")),
    }


async def soak(tasks_total: int, every: int, batch_size: int) -> dict[str, Any]:
    with world() as w:
        uris = upload(w.s3.client(), "soak", [(640, 480), (1280, 720)], 64)
        proc = start_worker(
            w,
            "soak-worker.log",
            WORKER_LOADER__BATCH_SIZE=str(batch_size),
            WORKER_LOADER__NUM_WORKERS="2",
        )
        outcomes = Outcomes("soak")
        try:
            samples = await sampled(w, proc, uris, tasks_total, every, outcomes)
        finally:
            code = stop_worker(proc)
    outcomes.check(tasks_total)
    return {
        "tasks": tasks_total,
        "batch_size": batch_size,
        "samples": samples,
        "exit_code": code,
        "outcomes": outcomes.summary(),
        "summary": summary(samples, tasks_total, every / batch_size),
    }


async def sampled(
    w: World, proc: Any, uris: list[str], tasks_total: int, every: int, outcomes: Outcomes
) -> list[dict[str, Any]]:
    """``tasks_total`` tasks cycling over ``uris``, a job of ``every`` at a time, the worker's
    tree sampled after each; every result counted in ``outcomes``."""
    settings = nats_settings(w)
    samples = []
    started = time.monotonic()
    async with client(settings, PIPELINE) as nc:
        submitted = 0
        for mark in range(every, tasks_total + 1, every):
            chunk = [uris[i % len(uris)] for i in range(submitted, mark)]
            job = Job(f"soak-{mark}", chunk)
            log = w.workdir / "soak-worker.log"
            await run_jobs(nc, settings, [job], timeout_s=600, worker=proc, log=log)
            for result in job.received():
                count(outcomes, result)
            submitted = mark
            samples.append(sample(proc.pid, mark, started))
            last = samples[-1]
            print(
                *(last[k] for k in ("tasks_done", "main_rss_mb", "loader_rss_mb")),
                *(last[k] for k in ("fds_total", "dev_shm_entries", "loader_pids")),
                flush=True,
            )
    return samples


def summary(
    samples: list[dict[str, Any]], tasks_total: int, batches_per_sample: float
) -> dict[str, Any]:
    """Growth after the first sample (the warm-up), and what stayed the same."""
    warm = samples[1:]
    rss_growth = (warm[-1]["main_rss_mb"] - warm[0]["main_rss_mb"]) if len(warm) > 1 else 0.0
    per_1000_batches = (
        rss_growth / ((len(warm) - 1) * batches_per_sample / 1000) if len(warm) > 1 else 0.0
    )
    return {
        "main_rss_growth_mb_after_warmup": round(rss_growth, 2),
        "main_rss_mb_per_1000_batches": round(per_1000_batches, 3),
        "fds_total_first_last": [samples[0]["fds_total"], samples[-1]["fds_total"]],
        "dev_shm_entries_first_last": [
            samples[0]["dev_shm_entries"],
            samples[-1]["dev_shm_entries"],
        ],
        "loader_pids_constant": len({tuple(s["loader_pids"]) for s in samples}) == 1,
        "images_per_s": round(tasks_total / samples[-1]["elapsed_s"], 1),
    }


@refusing
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--every", type=int, default=1_000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="40 tasks: outcomes only")
    args = parser.parse_args()
    if args.smoke:
        args.tasks, args.every = 40, 20
    result = asyncio.run(soak(args.tasks, args.every, args.batch_size))
    print(result["summary"])
    arenas = os.environ.get("MALLOC_ARENA_MAX")  # the allocator setting is part of the result
    result["malloc_arena_max"] = arenas
    print("saved", save(f"soak-malloc-arena-max-{arenas}" if arenas else "soak", result))


if __name__ == "__main__":
    main()
