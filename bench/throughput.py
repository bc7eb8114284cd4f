"""Throughput against the pipeline's limit, today's patterns, and per-job overhead, in one run.

    .venv/bin/python -m bench.throughput [--images 48] [--tasks 192] [--runs 3]

Writes bench/results/throughput.json and bench/results/throughput.png.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from bench.common.cli import run_benchmark
from bench.common.meters import last_json_line, median
from bench.common.stages import SIZES, stages
from bench.common.world import World, cycle, upload, world
from bench.outcomes import Outcomes, refusing

PATTERN_RUNS = 3


def pattern(w: World, name: str, uris_file: str, expected: int) -> dict[str, float]:
    """One run of a pattern of ``bench.patterns`` in its own process; ``BenchmarkFailed``
    unless it exited 0 having classified all ``expected`` images."""
    result, peak_bytes = last_json_line(
        [sys.executable, "-m", "bench.patterns", name, uris_file, w.s3.endpoint_url, w.weights],
        f"pattern {name}",
        timeout_s=1800,
    )
    outcomes = Outcomes(f"pattern {name}")
    outcomes.good(result["classified"])
    outcomes.check(expected)
    return {
        "images_per_s": result["images_per_s"],
        "cpu_ms_per_image": result["cpu_ms_per_image"],
        "peak_rss_bytes": peak_bytes,
    }


def chart(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loader = result["loader_alone"]
    patterns = result["patterns"]
    bars_of = [
        ("loader alone\n(default: reduced)", loader["default"]["images_per_s"], "#999"),
        ("loader alone\n(fast)", loader["fast"]["images_per_s"], "#bbb"),
        ("loader alone\n(exact)", loader["exact"]["images_per_s"], "#bbb"),
        ("worker (e2e)", result["end_to_end"]["images_per_s"], "#2a7"),
        ("(a) fork rebuilt\nfull-res f32", patterns["fork_rebuilt"]["images_per_s"], "#c55"),
        ("(b) DataLoader\nnum_workers=0", patterns["no_workers"]["images_per_s"], "#c55"),
        (
            "(c) forkserver rebuilt\nno preload",
            patterns["forkserver_rebuilt"]["images_per_s"],
            "#c55",
        ),
    ]
    fig, ax = plt.subplots(figsize=(11, 4.8))
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
        distinct = upload(w.s3.client(), "throughput", SIZES, images)
        uris = cycle(distinct, tasks)
        uris_file = w.workdir / "uris.json"
        uris_file.write_text(json.dumps(distinct))
        result = await stages(w, uris, images, tasks, runs, smoke)
        result["patterns"] = {}
        names = ["fork_rebuilt", "no_workers", "forkserver_rebuilt"]
        for name in names[:1] if smoke else names:  # the smoke: one pattern's outcomes
            runs_of = [
                pattern(w, name, str(uris_file), len(distinct))
                for _ in range(min(runs, PATTERN_RUNS))  # minutes each; three are plenty
            ]
            result["patterns"][name] = {
                "images_per_s": median([one["images_per_s"] for one in runs_of]),
                "cpu_ms_per_image": median([one["cpu_ms_per_image"] for one in runs_of]),
                "peak_rss_bytes": max(one["peak_rss_bytes"] for one in runs_of),
            }
    return result


@refusing
def main() -> None:
    result, path, smoke = run_benchmark("throughput", run)
    if not smoke:  # matplotlib is in the [bench] extra, not in the test suite's
        chart(result, str(path.with_suffix(".png")))


if __name__ == "__main__":
    main()
