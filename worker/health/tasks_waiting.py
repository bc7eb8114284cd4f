"""How many tasks wait for this process's pipelines, read from the task source now and then and
exported at scrape time: ``inference_worker_tasks_waiting{pipeline}`` and
``inference_worker_tasks_waiting_read_timestamp_seconds``.

A read is one sweep of the source's own counts (``worker.nats.waiting``: the consumers' info;
``worker.antenna.waiting``: the job listing's progress), made by a helper coroutine every
``WORKER_METRICS__TASKS_WAITING_READ_S`` (30 s by default), never by a scrape. We chose a
cached sweep on a timer over a read per scrape: the server's cost is then set by the setting,
not by how many Prometheus servers scrape or how often (at 30 s: NATS, 2 consumer listings a
minute per process, one per 256 consumers on the stream; Antenna, 2 job listings a minute per
process, one per 100 active jobs of each of its two active statuses). We chose a sweep of its
own over the reads the task path already makes (the job discovery's listing, the Antenna
rotation's ids-only listing): those stop when the task path wedges, which is the very case the
gauge must keep telling (alert ``InferenceWorkerAliveButNotConsuming``), and Antenna's ids-only
listing carries no counts.

A read is bounded (``READ_TIMEOUT_S``, and the interval) and runs on the event loop as an
``await`` of the source's client, never on the task path. A read that fails or times out
removes the ``tasks_waiting`` series until one succeeds (absent, not a stale number), and so
does a last read older than ``STALE_READS`` intervals (the event loop held up: the scrape,
served on its own thread, still answers); ``..._read_timestamp_seconds`` stays at the last
read that succeeded, so a dashboard can tell "0 waiting" from "not known".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from worker.health.metrics import PREFIX

log = structlog.get_logger(__name__)
READ_TIMEOUT_S = 10.0  # one sweep, all its calls (at most the interval)
STALE_READS = 3  # a last read older than this many intervals is no longer exported

WaitingRead = Callable[[], Awaitable[dict[str, int]]]


class TasksWaiting:
    """The last counts read (tasks waiting per pipeline label) and when; ``run`` reads them."""

    def __init__(self, read: WaitingRead, every_s: float) -> None:
        self._read = read
        self.every_s = every_s
        self.counts: dict[str, int] | None = None  # None: the last read failed, or none yet
        self.read_at: float | None = None  # Unix time of the last read that succeeded
        self._read_mono = float("-inf")
        self._failing = False

    async def read_once(self) -> bool:
        """One bounded read; whether it succeeded."""
        timeout_s = min(READ_TIMEOUT_S, self.every_s) if self.every_s > 0 else READ_TIMEOUT_S
        try:
            counts = await asyncio.wait_for(self._read(), timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - any failure: not known, said once
            self.counts = None
            if not self._failing:
                log.warning(
                    "tasks_waiting_read_failed",
                    error=f"{type(error).__name__}: {error}"[:300],
                    retry_in_s=self.every_s,
                )
            self._failing = True
            return False
        if self._failing:
            log.info("tasks_waiting_read_again")
        self._failing = False
        self.counts, self.read_at, self._read_mono = counts, time.time(), time.monotonic()
        return True

    async def run(self, stop: asyncio.Event) -> None:
        """Read every ``every_s`` until ``stop``; never raises (a failed read is a gap)."""
        if self.every_s <= 0:
            await stop.wait()
            return
        while not stop.is_set():
            await self.read_once()
            try:
                await asyncio.wait_for(stop.wait(), self.every_s)
            except TimeoutError:
                pass

    def current(self) -> dict[str, int] | None:
        """The counts to export now: None when the last read failed or is stale."""
        if self.counts is None:
            return None
        if time.monotonic() - self._read_mono > STALE_READS * max(self.every_s, 1.0):
            return None
        return self.counts

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        counts = self.current()
        if counts is not None:
            family = GaugeMetricFamily(
                f"{PREFIX}_tasks_waiting",
                "Tasks waiting for this process's pipelines, as last read from the source "
                "(NATS: not yet delivered by the shared consumer and the job consumers; "
                "Antenna: its active jobs' remaining images); absent while not known.",
                labels=["pipeline"],
            )
            for pipeline, count in sorted(counts.items()):
                family.add_metric([pipeline], float(count))
            yield family
        if self.read_at is not None:
            yield GaugeMetricFamily(
                f"{PREFIX}_tasks_waiting_read_timestamp_seconds",
                "Unix time of the last read of the tasks waiting that succeeded.",
                value=self.read_at,
            )
