"""The command line the throughput family of benchmarks shares: ``--images N --tasks T
--runs R [--smoke]``, the run, and its result recorded (``bench.common.records``)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from bench.common.records import save, stamp

SMOKE = {"images": 4, "tasks": 8, "runs": 1}


def run_benchmark(name: str, run: Any) -> tuple[dict[str, Any], Path, bool]:
    """``--images N --tasks T --runs R``: run ``run(images, tasks, runs)``, save, print.

    ``images`` distinct images are generated and uploaded; each job has ``tasks`` tasks that
    cycle over them (the loader keeps no cache, so a repeated image costs what a new one does).
    Jobs much longer than a batch keep the pipeline's fill and drain out of the rate.
    ``--smoke``: 4 images, 8-task jobs, one run (the test suite's check that it still works;
    its rates mean nothing). Every stage checks its outcomes first (``bench.outcomes``).
    """
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=48)
    parser.add_argument("--tasks", type=int, default=192)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny and quick: outcomes only")
    args = parser.parse_args()
    if args.smoke:
        args.images, args.tasks, args.runs = SMOKE["images"], SMOKE["tasks"], SMOKE["runs"]
    result = asyncio.run(run(args.images, args.tasks, args.runs, args.smoke))
    result.update(stamp(name))
    return result, save(name, result, echo=True), args.smoke
