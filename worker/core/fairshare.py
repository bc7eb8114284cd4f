"""Fair share across jobs: which waiting tasks form the next batch.

Every (pipeline, job) with waiting tasks has a queue. The next batch goes to the job that has
had the least service for its weight (stride scheduling: each job's ``pass`` grows by tasks
served / weight; the smallest pass goes next, on a tie the one served longest ago), so jobs with
pending tasks get batches in proportion to their weights (1 each by default). A batch is
that job's tasks, topped up from the other jobs of the same pipeline in the same order when
it has fewer than a batch: a batch never mixes pipelines. A job that arrives (or comes back
after its queue emptied) starts at the smallest pass of the jobs waiting, so it is served
next without being owed the time it was away.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
JobKey = tuple[str, str]  # (pipeline, job)


@dataclass
class _Job(Generic[T]):
    key: JobKey
    weight: float
    pass_: float
    served_at: int  # when it last had a batch (-1: never): ties go to the longest unserved
    tasks: deque[T] = field(default_factory=deque)


class FairQueue(Generic[T]):
    def __init__(self, weight: Callable[[JobKey], float] = lambda _key: 1.0) -> None:
        self._weight = weight
        self._jobs: dict[JobKey, _Job[T]] = {}
        self._batches = itertools.count()
        self._floor = 0.0  # the pass a job starts at: the smallest served so far

    def __len__(self) -> int:
        return sum(len(job.tasks) for job in self._jobs.values())

    def add(self, key: JobKey, item: T) -> None:
        job = self._jobs.get(key)
        if job is None:
            start = min((j.pass_ for j in self._jobs.values()), default=self._floor)
            job = _Job(key, max(self._weight(key), 1e-6), start, -1)
            self._jobs[key] = job
        job.tasks.append(item)

    def jobs(self) -> list[JobKey]:
        """The jobs with waiting tasks, in the order they would be served."""
        return [job.key for job in self._order()]

    def next_batch(self, size: int, usable: Callable[[str], bool] = lambda _p: True) -> list[T]:
        """Up to ``size`` tasks of one pipeline, the fairest job's first; [] when none waits
        (or none of a pipeline ``usable`` says yes to)."""
        order = [job for job in self._order() if usable(job.key[0])]
        if not order:
            return []
        pipeline = order[0].key[0]
        now = next(self._batches)
        batch: list[T] = []
        for job in (j for j in order if j.key[0] == pipeline):
            taken = 0
            while job.tasks and len(batch) < size:
                batch.append(job.tasks.popleft())
                taken += 1
            job.pass_ += taken / job.weight
            job.served_at = now
            if not job.tasks:
                self._floor = max(self._floor, job.pass_)
                del self._jobs[job.key]
            if len(batch) >= size:
                break
        return batch

    def take_pipeline(self, pipeline: str) -> list[T]:
        """Every waiting task of ``pipeline`` (its model cannot be had)."""
        taken: list[T] = []
        for key in [key for key in self._jobs if key[0] == pipeline]:
            taken.extend(self._jobs.pop(key).tasks)
        return taken

    def take_jobs(self, job_ids: Collection[str]) -> list[T]:
        """Every waiting task of the jobs ``job_ids`` (no longer active at their source)."""
        taken: list[T] = []
        for key in [key for key in self._jobs if key[1] in job_ids]:
            taken.extend(self._jobs.pop(key).tasks)
        return taken

    def take_all(self) -> list[T]:
        taken = [item for job in self._jobs.values() for item in job.tasks]
        self._jobs.clear()
        return taken

    def __iter__(self) -> Iterator[T]:
        for job in self._jobs.values():
            yield from job.tasks

    def _order(self) -> list[_Job[T]]:
        return sorted(self._jobs.values(), key=lambda job: (job.pass_, job.served_at))
