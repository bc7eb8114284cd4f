"""The throughput benchmark's three stages only (loader alone, model alone, the worker end to
end, interleaved round by round), without today's patterns: the quick check that a change
meant to move no figure moved none. Same data and settings as ``bench.throughput``.

    .venv/bin/python -m bench.stages --runs 5
"""

from __future__ import annotations

from typing import Any

from bench.common import cycle, run_benchmark, upload, world
from bench.throughput import SIZES, stages


async def run(images: int, tasks: int, runs: int) -> dict[str, Any]:
    with world() as w:
        uris = cycle(upload(w.s3.client(), "throughput", SIZES, images), tasks)
        return await stages(w, uris, images, tasks, runs)


def main() -> None:
    run_benchmark("stages", run)


if __name__ == "__main__":
    main()
