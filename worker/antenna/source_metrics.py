"""The Antenna source's metrics, in the worker's registry: calls by endpoint and status,
reservations held, seconds left on the oldest one, result posts retried and split."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from worker.health.metrics import PREFIX


class AntennaMetrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        held: Callable[[], int],
        oldest_seconds_left: Callable[[], float],
    ) -> None:
        self.calls = Counter(
            f"{PREFIX}_antenna_requests",
            "Calls to Antenna's API by endpoint (jobs, job, tasks, result, register) and HTTP "
            "status, or 'unreachable' (no answer within the call's deadline) or 'bad_answer' (a "
            "redirect, or a 2xx that is not the endpoint's JSON).",
            ["endpoint", "status"],
            registry=registry,
        )
        self.posts_retried = Counter(
            f"{PREFIX}_antenna_result_posts_retried",
            "Result posts made again with the identical body (connection error, 429, 5xx).",
            registry=registry,
        )
        self.posts_split = Counter(
            f"{PREFIX}_antenna_result_posts_split",
            "Extra bodies a result post was split into (size cap, a 413, a 400).",
            registry=registry,
        )
        registry.register(_Reservations(held, oldest_seconds_left))

    def count_call(self, endpoint: str, status: str) -> None:
        self.calls.labels(endpoint, status).inc()


class _Reservations:
    def __init__(self, held: Callable[[], int], oldest_seconds_left: Callable[[], float]) -> None:
        self._held = held
        self._left = oldest_seconds_left

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        yield GaugeMetricFamily(
            f"{PREFIX}_antenna_reservations_held",
            "Tasks reserved from Antenna and not yet posted or left to redelivery.",
            value=float(self._held()),
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_antenna_oldest_reservation_seconds_left",
            "Seconds before the oldest reservation held runs out (Antenna then delivers its "
            "task again); the reservation time when none is held.",
            value=float(self._left()),
        )
