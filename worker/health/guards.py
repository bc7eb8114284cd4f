"""Resource guards: memory of the whole process tree and descriptors per process.

The idea of Celery's ``worker_max_memory_per_child``, done without losing work: crossing a
limit makes the worker finish its batch, give back what it holds, and exit with code 4 so
supervisord starts a fresh process.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from config.names import env_name
from config.settings import GuardSettings
from worker.health.procstats import collect_stats


class ResourceGuard:
    def __init__(
        self,
        settings: GuardSettings,
        loader_pids: Callable[[], list[int]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._loader_pids = loader_pids
        self._clock = clock
        self._next_check = 0.0

    @property
    def enabled(self) -> bool:
        return bool(self._settings.max_tree_rss_bytes or self._settings.max_open_fds)

    def check(self) -> str | None:
        """Why the process must be replaced, or None; reads /proc at most once an interval."""
        now = self._clock()
        if not self.enabled or now < self._next_check:
            return None
        self._next_check = now + self._settings.check_interval_s
        stats, _shm = collect_stats(set(self._loader_pids()))
        rss = sum(stat.rss_bytes for stat in stats)
        limit = self._settings.max_tree_rss_bytes
        if limit and rss > limit:
            return (
                f"resident memory of the process tree is {rss} bytes, over "
                f"{env_name('guards', 'max_tree_rss_bytes')}={limit}"
            )
        fds_limit = self._settings.max_open_fds
        worst = max(stats, key=lambda stat: stat.open_fds, default=None)
        if fds_limit and worst is not None and worst.open_fds > fds_limit:
            return (
                f"{worst.role} process {worst.pid} has {worst.open_fds} open descriptors, over "
                f"{env_name('guards', 'max_open_fds')}={fds_limit}"
            )
        return None
