"""Throughput against the pipeline's limit, and per-job overhead, in one run: the worker's
loader alone (by its default, fast and exact paths), its model alone and the worker end to
end, interleaved round by round, then one-image jobs timed from publish to result. Every
stage checks its outcomes before a rate is reported.

    .venv/bin/python -m bench.throughput [--images 48] [--tasks 192] [--runs 3]
    .venv/bin/python -m bench.throughput --smoke     # outcomes only (the test suite runs it)

Writes bench/results/throughput.json and bench/results/throughput.png. (AMI's pattern is
compared on the real workload: ``bench.workload``.)
"""

from __future__ import annotations

from typing import Any

from bench.common.bench_args import run_benchmark
from bench.common.stages import SIZES, stages
from bench.common.world import cycle, upload, world
from bench.outcomes import refusing


def chart(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loader = result["loader_alone"]
    bars_of = [
        ("loader alone\n(default: reduced)", loader["default"]["images_per_s"], "#999"),
        ("loader alone\n(fast)", loader["fast"]["images_per_s"], "#bbb"),
        ("loader alone\n(exact)", loader["exact"]["images_per_s"], "#bbb"),
        ("worker (e2e)", result["end_to_end"]["images_per_s"], "#2a7"),
    ]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    bars = ax.bar([b[0] for b in bars_of], [b[1] for b in bars_of], color=[b[2] for b in bars_of])
    ax.bar_label(bars, fmt="%.1f")
    ax.set_ylabel("images/s (median)")
    ax.set_title(
        f"{result['tasks_per_job']}-task jobs over {result['images']} JPEGs, "
        f"1920x1080 and 4096x2160; {result['machine']['cores']} cores, CPU; {result['date']}\n"
        f"model alone {result['model_alone_images_per_s']:.0f} images/s; worker / slower stage "
        f"= {result['ratio_end_to_end_to_slower_stage']:.2f} (median of rounds)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def run(images: int, tasks: int, runs: int, smoke: bool = False) -> dict[str, Any]:
    with world() as w:
        uris = cycle(upload(w.s3.client(), "throughput", SIZES, images), tasks)
        return await stages(w, uris, images, tasks, runs, smoke)


@refusing
def main() -> None:
    result, path, smoke = run_benchmark("throughput", run)
    if not smoke:  # matplotlib is in the [bench] extra, not in the test suite's
        chart(result, str(path.with_suffix(".png")))


if __name__ == "__main__":
    main()
