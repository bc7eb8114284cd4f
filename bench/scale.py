"""Scaling out on one host: one worker process against two sharing the durable consumer.

    .venv/bin/python -m bench.scale [--images 48] [--tasks 192] [--runs 3]

Same cores, same loader children in total (2): 1 process x 2 loader workers, then 2 processes
x 1 loader worker each; every job's results are checked (all ``ok``) before its rate counts.
Writes bench/results/scale.json. ``--smoke``: outcomes only (the test suite runs it).
"""

from __future__ import annotations

from typing import Any

from bench.common.cli import run_benchmark
from bench.common.meters import machine
from bench.common.stages import SIZES, end_to_end
from bench.common.world import cycle, upload, world
from bench.outcomes import refusing


async def run(images: int, tasks: int, runs: int, smoke: bool = False) -> dict[str, Any]:
    with world() as w:
        uris = cycle(upload(w.s3.client(), "scale", SIZES, images), tasks)
        one = {"images_per_s": 0.0}
        if not smoke:  # the smoke runs the layout that differs from bench.stages' worker
            one = await end_to_end(w, uris, runs, processes=1, loader_workers=2)
        two = await end_to_end(w, uris, runs, processes=2, loader_workers=1)
    return {
        "machine": machine(),
        "images": images,
        "tasks_per_job": tasks,
        "runs": runs,
        "one_process_two_loader_workers": one["images_per_s"],
        "two_processes_one_loader_worker_each": two["images_per_s"],
    }


@refusing
def main() -> None:
    run_benchmark("scale", run)


if __name__ == "__main__":
    main()
