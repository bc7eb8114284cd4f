"""What a benchmark measures besides time: the resident memory and CPU of process trees, the
machine's busy CPU, the machine itself, and a compared pattern run in a process of its own."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

from bench.outcomes import BenchmarkFailed


def _tree(pid: int) -> list[int]:
    try:
        root = psutil.Process(pid)
        return [pid, *(child.pid for child in root.children(recursive=True))]
    except psutil.Error:
        return []


def tree(pid: int) -> Callable[[], list[int]]:
    """The pids of ``pid`` and its descendants, as they are when called."""
    return lambda: _tree(pid)


class PeakRss:
    """Samples the summed resident memory of a process tree (or of the processes ``pids()``
    names) every 50 ms; ``peak_bytes`` when done."""

    def __init__(self, pid: int = 0, pids: Callable[[], list[int]] | None = None) -> None:
        self._pids = pids or (lambda: _tree(pid))
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0
            for pid in self._pids():
                try:
                    total += psutil.Process(pid).memory_info().rss
                except psutil.Error:
                    pass
            self.peak_bytes = max(self.peak_bytes, total)
            self._stop.wait(0.05)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


class TreeCpu:
    """Process CPU seconds (user + system) of the processes ``pids()`` names, summed over
    ``with`` blocks: what those processes spent, whatever else the machine ran."""

    def __init__(self, pids: Callable[[], list[int]]) -> None:
        self._pids = pids
        self.cpu_s = 0.0

    def _read(self) -> dict[int, float]:
        times = {}
        for pid in self._pids():
            try:
                t = psutil.Process(pid).cpu_times()
            except psutil.Error:
                continue
            times[pid] = float(t.user + t.system)
        return times

    def __enter__(self) -> TreeCpu:
        self._start = self._read()
        return self

    def __exit__(self, *_exc: object) -> None:
        end = self._read()
        self.cpu_s += sum(cpu - self._start.get(pid, 0.0) for pid, cpu in end.items())

    def ms_per_image(self, images: int) -> float:
        return round(1000 * self.cpu_s / max(1, images), 2)


class CpuMeter:
    """Machine-wide busy CPU seconds over a ``with`` block (all processes, every core)."""

    busy_s = 0.0
    wall_s = 0.0

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()
        return float(t.user + t.nice + t.system + getattr(t, "irq", 0) + getattr(t, "softirq", 0))

    def __enter__(self) -> CpuMeter:
        self._busy0, self._wall0 = self._busy(), time.perf_counter()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.busy_s += self._busy() - self._busy0
        self.wall_s += time.perf_counter() - self._wall0

    def summary(self, images: int) -> dict[str, float]:
        cores = os.cpu_count() or 1
        return {
            "cpu_busy_fraction": self.busy_s / (self.wall_s * cores),
            "cpu_ms_per_image": 1000 * self.busy_s / images,
        }


def machine() -> dict[str, Any]:
    import torch

    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def last_json_line(args: list[str], what: str, timeout_s: float) -> tuple[dict[str, Any], int]:
    """Run ``args`` (a pattern compared against, in a process of its own): the JSON of the
    last line it printed, and its peak resident bytes; ``BenchmarkFailed`` with the end of its
    stderr unless it exited 0 having printed one."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with PeakRss(proc.pid) as peak:
        out, err = proc.communicate(timeout=timeout_s)
    lines = out.decode().strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = " | ".join(err.decode(errors="replace").strip().splitlines()[-3:])
        raise BenchmarkFailed(f"{what} exited {proc.returncode}: {tail}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result, peak.peak_bytes
