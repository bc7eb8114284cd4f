"""The NATS source's own metrics, read at scrape time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from config.names import env_name
from worker.health.metrics import PREFIX


class JobConsumersCollector:
    """Fair share's job consumers (``worker.nats.consumer_stats``): how many exist, the bound,
    and those made, deleted and refused by the server. ``stats`` returns an object with
    ``existing``, ``bound``, ``made``, ``deleted``, ``refused`` and ``updated``."""

    def __init__(self, stats: Callable[[], Any]) -> None:
        self._stats = stats

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self._stats()
        if stats is None:
            return
        yield GaugeMetricFamily(
            f"{PREFIX}_job_consumers",
            "Job consumers of this fleet on the tasks stream, as last listed.",
            value=float(stats.existing),
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_job_consumers_bound",
            "The most job consumers that may exist at once "
            f"({env_name('nats', 'max_job_consumers')}, at most half the server's "
            "per-stream limit).",
            value=float(stats.bound),
        )
        for what, value, text in (
            ("made", stats.made, "Job consumers made by this process."),
            ("deleted", stats.deleted, "Finished jobs' consumers deleted by this process."),
            (
                "refused",
                stats.refused,
                "Job consumers the server refused to make (its consumer limit reached).",
            ),
            (
                "updated",
                stats.updated,
                "Job consumers listed with other delivery settings and given this process's.",
            ),
        ):
            yield CounterMetricFamily(f"{PREFIX}_job_consumers_{what}", text, value=float(value))
