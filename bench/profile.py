"""Where the end-to-end time goes: py-spy samples every thread of a worker during a job.

    .venv/bin/python -m bench.profile [--images 96]

Writes bench/results/profile.txt: the share of samples per function (self time) and per
frame anywhere on the stack (total time), main process only (loader children are separate).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.common.jobs import run_job
from bench.common.results import result_path
from bench.common.stages import SIZES
from bench.common.world import PIPELINE, nats_settings, start_worker, stop_worker, upload, world
from bench.outcomes import BenchmarkFailed, refusing
from worker.nats.connection import connect
from worker.nats.provision import provision


def summarize(raw: Path, top: int = 25) -> str:
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        samples += n
        frames = stack.split(";")
        own[frames[-1]] += n
        for frame in set(frames):
            total[frame] += n
    lines = [f"{samples} samples", "", "self time (top frames):"]
    lines += [f"{100 * n / samples:6.1f}%  {frame}" for frame, n in own.most_common(top)]
    lines += ["", "total time (anywhere on the stack), our modules:"]
    ours = [(f, n) for f, n in total.most_common() if "(worker/" in f or "(datasets/" in f]
    lines += [f"{100 * n / samples:6.1f}%  {frame}" for frame, n in ours[:top]]
    return "\n".join(lines)


async def run(images: int) -> Path:
    with world() as w:
        uris = upload(w.s3.client(), "profile", SIZES, images)
        settings = nats_settings(w)
        nc = await connect(settings)
        js = nc.jetstream()
        await provision(js, settings, PIPELINE)
        proc = start_worker(w, "profile-worker.log", WORKER_LOADER__BATCH_SIZE="16")
        raw = result_path("profile.raw")
        try:
            await run_job(js, settings, "warm", uris[:16])
            spy = subprocess.Popen(
                [
                    shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"),
                    "record",
                    "--pid",
                    str(proc.pid),
                    "--format",
                    "raw",
                    "--rate",
                    "200",
                    "--output",
                    str(raw),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(1.0)
            await run_job(js, settings, "profiled", uris)  # checks every result is ok
            spy.send_signal(2)
            spy.wait(timeout=30)
            if not raw.exists() or not raw.read_text().strip():
                raise BenchmarkFailed(f"py-spy recorded no samples (exit {spy.returncode})")
        finally:
            stop_worker(proc)
            await nc.close()
    out = result_path("profile.txt")
    out.write_text(summarize(raw) + "\n")
    raw.unlink(missing_ok=True)
    return out


@refusing
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=96)
    parser.add_argument("--smoke", action="store_true", help="8 images: outcomes only")
    args = parser.parse_args()
    if args.smoke:
        args.images = 8
    print(asyncio.run(run(args.images)).read_text())


if __name__ == "__main__":
    main()
