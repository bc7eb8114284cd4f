"""The throughput benchmark's stages only (the loader alone by its default, fast and exact
paths, the model alone, the worker end to end, interleaved round by round), without today's
patterns: the quick check that a change meant to move no figure moved none. Same data and
settings as ``bench.throughput``; every stage checks its outcomes before a rate is reported.

    .venv/bin/python -m bench.stages --runs 5
    .venv/bin/python -m bench.stages --smoke     # outcomes only (the test suite runs it)
"""

from __future__ import annotations

from typing import Any

from bench.common.cli import run_benchmark
from bench.common.stages import SIZES, stages
from bench.common.world import cycle, upload, world
from bench.outcomes import refusing


async def run(images: int, tasks: int, runs: int, smoke: bool = False) -> dict[str, Any]:
    with world() as w:
        uris = cycle(upload(w.s3.client(), "throughput", SIZES, images), tasks)
        return await stages(w, uris, images, tasks, runs, smoke)


@refusing
def main() -> None:
    run_benchmark("stages", run)


if __name__ == "__main__":
    main()
