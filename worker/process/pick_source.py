"""The one place a task source is picked (``WORKER_SOURCE``): its parts, and the pipelines it
refuses. The only module outside the sources' rooms that imports them."""

from __future__ import annotations

from config.faults import FaultSettings
from config.settings import Settings
from pipelines.declare import Pipeline
from pipelines.setup import Chosen
from worker.core.link import SourceParts
from worker.engine.served import ServedPipelines
from worker.health.metrics import Metrics


def refusals(s: Settings, pipelines: list[Pipeline]) -> list[str]:
    """Why the source cannot serve some of ``pipelines`` (Antenna: no detector), one line each."""
    if s.source != "antenna":
        return []
    from worker.antenna.keepable import refusals as antenna_refusals

    return antenna_refusals(pipelines)


def source_parts(
    s: Settings,
    served: ServedPipelines,
    chosen: list[Chosen],
    metrics: Metrics,
    faults: FaultSettings,
) -> SourceParts:
    """The source's parts, not yet open, counting into ``metrics`` (its own metrics registered
    in ``metrics.registry``), with the test hooks in ``faults`` that are theirs."""
    if s.source == "antenna":
        from worker.antenna.parts import AntennaParts

        return AntennaParts(s, served, {c.pipeline.name: c.pipeline for c in chosen}, metrics)
    from worker.nats.parts import NatsParts

    return NatsParts(s, served, metrics, slow_store_s=faults.slow_store_s)
