"""Batches across pipelines when the memory budget holds only one of them: a model switch is
paid for by a hold (``WORKER_MODEL__HOLD_PER_LOAD``), not made for every batch."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

from config.errors import Failure
from tests.fakes import FakeEngine
from worker.batches import MAX_HOLD_S, Batches
from worker.ports import BatchReport

LOAD_S = 1.0  # on the fake clock
BATCH_S = 0.25


class OneModelEngine(FakeEngine):
    """Holds one pipeline's models at a time (a budget that fits one); loads and batches
    move a fake clock."""

    def __init__(self, load_s: float) -> None:
        super().__init__()
        self.load_s = load_s
        self.now_s = 0.0
        self.ran: list[tuple[str, float]] = []  # (pipeline, when) per batch

    def load(self, pipeline: str) -> Failure | None:
        self.now_s += self.load_s
        self.loaded[:] = [pipeline]
        return None

    def run_batch(self, keys: Sequence[int], pipeline: str = "") -> BatchReport:
        assert self.ready(pipeline), "a batch ran without its models"
        self.now_s += BATCH_S
        self.ran.append((pipeline, self.now_s))
        return super().run_batch(keys, pipeline)


def claim(key: int, pipeline: str, job: str) -> Any:
    task = SimpleNamespace(pipeline=pipeline, job_id=job, image_url=f"s3://b/{job}/{key}.jpg")
    return SimpleNamespace(key=key, task=task, msg=None, delivered=1, fetched_at=0.0)


async def run(hold_per_load: float, tasks_per_job: int, load_s: float = LOAD_S) -> OneModelEngine:
    engine = OneModelEngine(load_s)
    settled: list[int] = []
    total = 2 * tasks_per_job
    done = asyncio.Event()

    async def prepare(pipeline: str) -> Failure | None:
        return None if engine.ready(pipeline) else engine.load(pipeline)

    async def settle(batch: list[Any], report: BatchReport) -> None:
        settled.extend(h.key for h in batch)
        if len(settled) >= total:
            done.set()

    with ThreadPoolExecutor(1) as thread:
        batches = Batches(
            2,
            engine,
            thread,
            lambda _b, _r: None,
            settle,
            prepare=prepare,
            hold_per_load=hold_per_load,
            clock=lambda: engine.now_s,
        )
        batches.add([claim(i, "animals", "job-a") for i in range(tasks_per_job)])
        batches.add([claim(total + i, "colours", "job-c") for i in range(tasks_per_job)])
        running = asyncio.create_task(batches.run())
        await asyncio.wait_for(done.wait(), 30)
        batches.stop()
        await asyncio.wait_for(running, 30)
    assert sorted(settled) == sorted([*range(tasks_per_job), *range(total, total + tasks_per_job)])
    return engine


def switches(engine: OneModelEngine) -> int:
    pipelines = [p for p, _ in engine.ran]
    return 1 + sum(a != b for a, b in itertools.pairwise(pipelines))


async def test_without_a_hold_two_pipelines_that_do_not_fit_together_load_for_every_batch():
    engine = await run(hold_per_load=0.0, tasks_per_job=40)
    assert switches(engine) == 40  # 40 batches, alternating: a load each


async def test_a_hold_pays_for_each_load_with_runs_of_the_loaded_pipeline():
    engine = await run(hold_per_load=4.0, tasks_per_job=40)
    # a load (1 s) holds 4 s = 16 batches of 0.25 s: 20 batches a job make 4 runs in all
    assert switches(engine) == 4
    # each full run is 16 batches for a 1 s load (loading 1/(1+4) of that stretch), and the
    # job that waited is served next: shares even out
    runs = [(p, len(list(group))) for p, group in itertools.groupby(p for p, _ in engine.ran)]
    assert runs == [("animals", 16), ("colours", 16), ("animals", 4), ("colours", 4)]


async def test_no_hold_is_longer_than_its_cap():
    # a 20 s load at 4x would hold 80 s (320 batches: each job's 200 in one run); the cap of
    # 30 s makes runs of 120 batches: the other job waits no more than that
    assert 4.0 * 20.0 > MAX_HOLD_S == 30.0
    engine = await run(hold_per_load=4.0, tasks_per_job=400, load_s=20.0)
    runs = [(p, len(list(group))) for p, group in itertools.groupby(p for p, _ in engine.ran)]
    assert runs == [("animals", 120), ("colours", 120), ("animals", 80), ("colours", 80)]
