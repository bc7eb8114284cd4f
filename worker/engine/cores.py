"""How many cores this process may use: the CPUs it is pinned to (``sched_getaffinity``),
fewer where a cgroup's CPU quota allows less (``cpu.max`` on cgroup v2, ``cpu.cfs_quota_us``
over ``cpu.cfs_period_us`` on v1; a quota of 1.5 CPUs counts as 2). Read once, at start."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def available_cores(cgroup: Path = CGROUP) -> int:
    """At least 1."""
    try:
        pinned = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        pinned = os.cpu_count() or 1
    quota = cgroup_quota(cgroup)
    if quota is not None:
        pinned = min(pinned, max(1, math.ceil(quota)))
    return max(1, pinned)


def cgroup_quota(cgroup: Path = CGROUP) -> float | None:
    """The CPUs the cgroup's quota allows, or None where there is none (or none readable)."""
    v2 = _read(cgroup / "cpu.max")
    if v2 is not None:
        parts = v2.split()
        if len(parts) == 2 and parts[0] != "max":
            return _ratio(parts[0], parts[1])
        return None
    quota = _read(cgroup / "cpu" / "cpu.cfs_quota_us") or _read(cgroup / "cpu.cfs_quota_us")
    period = _read(cgroup / "cpu" / "cpu.cfs_period_us") or _read(cgroup / "cpu.cfs_period_us")
    if quota is None or period is None:
        return None
    return _ratio(quota, period)


def _ratio(quota: str, period: str) -> float | None:
    try:
        allowed, each = int(quota), int(period)
    except ValueError:
        return None
    if allowed <= 0 or each <= 0:  # -1: no quota
        return None
    return allowed / each


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None
