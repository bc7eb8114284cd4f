"""After each batch: liveness, metrics and the resource guards, updated on the event loop."""

from __future__ import annotations

from collections.abc import Callable

import structlog

from worker.core.ports import BatchReport
from worker.health.liveness import Liveness
from worker.health.metrics import Metrics

log = structlog.get_logger(__name__)


class BatchObserver:
    """After each batch: progress for liveness, metrics, the batch's log line, and the
    resource guards, which ask for a fresh process through ``on_limit``."""

    def __init__(
        self,
        metrics: Metrics,
        liveness: Liveness,
        guard: Callable[[], str | None] = lambda: None,
        on_limit: Callable[[str], None] = lambda _reason: None,
    ) -> None:
        self._metrics = metrics
        self._liveness = liveness
        self._guard = guard
        self._on_limit = on_limit

    def batch_done(self, size: int, report: BatchReport, pipeline: str = "") -> None:
        m = self._metrics
        ok = sum(1 for outcome in report.outcomes.values() if outcome.ok)
        self._liveness.batch_completed()
        m.batches.inc()
        m.images.inc(ok)
        m.observe_stage("load", pipeline, report.load_s)
        m.observe_stage("infer", pipeline, report.infer_s)
        if report.loader_restarts:
            m.loader_restarts.inc(report.loader_restarts)
        self._check_guards()
        log.info(
            "batch_done",
            size=size,
            ok=ok,
            load_s=round(report.load_s, 4),
            infer_s=round(report.infer_s, 4),
            loader_restarts=report.loader_restarts,
        )

    def _check_guards(self) -> None:
        try:
            reason = self._guard()
        except Exception:  # a guard that cannot read /proc this time must not stop the work
            log.exception("guard_check_failed", hint="checked again after the next batch")
            return
        if reason:
            self._on_limit(reason)
