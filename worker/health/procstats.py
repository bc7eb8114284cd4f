"""Resident memory, open descriptors and /dev/shm bytes of the worker's whole process tree.

Read from /proc at scrape time (psutil); roles: ``main``, ``loader`` (DataLoader children),
``forkserver`` and ``other`` (any other descendant, e.g. the resource tracker).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import psutil
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class ProcStat:
    pid: int
    role: str
    rss_bytes: int
    open_fds: int


def _role(proc: psutil.Process, loader_pids: set[int]) -> str:
    if proc.pid in loader_pids:
        return "loader"
    try:
        cmdline = " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return "other"
    return "forkserver" if "forkserver" in cmdline else "other"


def process_tree(loader_pids: set[int]) -> list[tuple[psutil.Process, str]]:
    me = psutil.Process()
    tree = [(me, "main")]
    try:
        children = me.children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    tree.extend((child, _role(child, loader_pids)) for child in children)
    return tree


def shm_bytes(pid: int, seen: set[int]) -> int:
    """Bytes of /dev/shm files that ``pid`` holds open or mapped (unlinked ones included).

    ``seen`` holds inodes already counted, so a segment shared by two processes counts once.
    """
    total = 0
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return 0
    for fd in fds:
        path = f"{fd_dir}/{fd}"
        try:
            if not os.readlink(path).startswith(SHM_DIR + "/"):
                continue
            st = os.stat(path)
        except OSError:
            continue
        if st.st_ino not in seen:
            seen.add(st.st_ino)
            total += st.st_size
    try:
        with open(f"/proc/{pid}/maps") as maps:
            lines = [line.split() for line in maps if SHM_DIR + "/" in line]
    except OSError:
        return total
    for fields in lines:
        inode = int(fields[4])
        if inode not in seen:
            seen.add(inode)
            start, end = fields[0].split("-")
            total += int(end, 16) - int(start, 16)
    return total


def collect_stats(loader_pids: set[int]) -> tuple[list[ProcStat], int]:
    stats: list[ProcStat] = []
    seen: set[int] = set()
    shm_total = 0
    for proc, role in process_tree(loader_pids):
        try:
            with proc.oneshot():
                stats.append(ProcStat(proc.pid, role, proc.memory_info().rss, proc.num_fds()))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        shm_total += shm_bytes(proc.pid, seen)
    return stats, shm_total


class ProcessTreeCollector(Collector):
    """Per-role sums for the main process, its loader children and the forkserver."""

    def __init__(self, prefix: str, loader_pids: Callable[[], list[int]]) -> None:
        self._prefix = prefix
        self._loader_pids = loader_pids

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats, shm_total = collect_stats(set(self._loader_pids()))
        rss = GaugeMetricFamily(
            f"{self._prefix}_process_resident_memory_bytes",
            "Resident memory of the worker's processes, by role.",
            labels=["role"],
        )
        fds = GaugeMetricFamily(
            f"{self._prefix}_process_open_fds",
            "Open file descriptors of the worker's processes, by role.",
            labels=["role"],
        )
        count = GaugeMetricFamily(
            f"{self._prefix}_processes", "Processes in the worker's tree, by role.", labels=["role"]
        )
        for role in ("main", "loader", "forkserver", "other"):
            members = [s for s in stats if s.role == role]
            rss.add_metric([role], float(sum(s.rss_bytes for s in members)))
            fds.add_metric([role], float(sum(s.open_fds for s in members)))
            count.add_metric([role], float(len(members)))
        yield rss
        yield fds
        yield count
        yield GaugeMetricFamily(
            f"{self._prefix}_shm_bytes",
            "Bytes of /dev/shm held open or mapped by the worker's processes.",
            value=float(shm_total),
        )
        limit = _fd_limit()
        if limit:
            yield GaugeMetricFamily(
                f"{self._prefix}_max_fds",
                "The main process's open-descriptor limit (RLIMIT_NOFILE soft).",
                value=float(limit),
            )


def _fd_limit() -> int:
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 0


def living(pids: list[int]) -> list[int]:
    """The pids among ``pids`` that are still running (zombies count as gone)."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive
