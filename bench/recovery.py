"""Recovery from a stopped loader child: our explicit teardown against torch's own.

    .venv/bin/python -m bench.recovery [--runs 3]

Each run starts a forkserver DataLoader with two children, SIGSTOPs one, then tears the
loader down: ours (SIGKILL and reap every child, close the queues) or torch's
(``_shutdown_workers``, what ``del iterator`` does). Reports seconds and children left alive.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from typing import Any

from torch.utils.data import DataLoader

from bench.common.meters import machine, median
from bench.common.results import save
from bench.outcomes import BenchmarkFailed, refusing
from datasets.images import DecodePlan
from datasets.loader import LoaderConfig, StreamingLoader, _init_child
from worker.health.procstats import living


def ours() -> tuple[float, int]:
    loader = StreamingLoader(
        LoaderConfig(num_workers=2, timeout_s=5, plan=DecodePlan(size=64, fast=True))
    )
    loader.start()
    pids = loader.child_pids()
    os.kill(pids[0], signal.SIGSTOP)
    started = time.perf_counter()
    loader.close()
    elapsed = time.perf_counter() - started
    return elapsed, len(living(pids))


def torchs() -> tuple[float, int]:
    import multiprocessing as mp

    from datasets.loader import RequestStream
    from datasets.sources import SourceConfig

    ctx = mp.get_context("forkserver")
    dataset = RequestStream(
        ctx.Queue(), ctx.Queue(), DecodePlan(size=64, fast=True), SourceConfig()
    )
    it: Any = iter(
        DataLoader(
            dataset,
            batch_size=None,
            num_workers=2,
            multiprocessing_context=ctx,
            timeout=5,
            worker_init_fn=_init_child,
        )
    )
    pids = [w.pid for w in it._workers]
    os.kill(pids[0], signal.SIGSTOP)
    started = time.perf_counter()
    it._shutdown_workers()
    elapsed = time.perf_counter() - started
    left = living(pids)
    for pid in left:  # clean up after torch
        os.kill(pid, signal.SIGKILL)
    return elapsed, len(left)


@refusing
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="one run: outcomes only")
    args = parser.parse_args()
    if args.smoke:
        args.runs = 1
    result: dict[str, Any] = {"machine": machine(), "runs": args.runs}
    teardowns = [("ours", ours), ("torch_shutdown_workers", torchs)]
    for name, teardown in teardowns[:1] if args.smoke else teardowns:  # torch's takes 10 s
        times, left = [], []
        for _ in range(args.runs):
            seconds, alive_after = teardown()
            times.append(seconds)
            left.append(alive_after)
        if name == "ours" and any(left):
            raise BenchmarkFailed(f"our teardown left children alive: {left}")
        result[name] = {
            "median_s": round(median(times), 3),
            "max_s": round(max(times), 3),
            "children_left_alive": left,
        }
        print(name, result[name], flush=True)
    print("saved", save("recovery", result))


if __name__ == "__main__":
    main()
