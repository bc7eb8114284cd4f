"""Every metric the worker exports is named in the docs (docs/metrics.md, or beside the feature
it measures), so an operator can look up what a series means without reading the code."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from worker.antenna.source_metrics import AntennaMetrics
from worker.health.liveness import Liveness
from worker.health.metrics import (
    PREFIX,
    DeviceCollector,
    Metrics,
    ModelsCollector,
    ReadsCollector,
    UnavailableCollector,
)
from worker.nats.source_metrics import JobConsumersCollector

ROOT = Path(__file__).parents[2]


def _documented() -> set[str]:
    """Metric names the docs write out, ``..._name`` (short for the prefix) included."""
    text = "".join(p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
    full = set(re.findall(rf"\b({PREFIX}_[a-z0-9_]*[a-z0-9])", text))
    short = {f"{PREFIX}_{name}" for name in re.findall(r"\.\.\._([a-z0-9_]*[a-z0-9])", text)}
    return full | short


def _written_in_the_code() -> set[str]:
    """Every metric name the code spells out whole (``f"{PREFIX}_name"``)."""
    sources = "".join(p.read_text() for p in (ROOT / "worker").rglob("*.py"))
    return {f"{PREFIX}_{n}" for n in re.findall(r'f"\{PREFIX\}_([a-z0-9_]*[a-z0-9])"', sources)}


def _registered() -> set[str]:
    """The families a registry holds with the core's, Antenna's and every collector's metrics
    (those whose names are made from parts included)."""
    registry = CollectorRegistry()
    Metrics(registry, Liveness(stall_timeout_s=60.0))
    AntennaMetrics(registry, held=lambda: 0, oldest_seconds_left=lambda: 0.0)
    registry.register(DeviceCollector(lambda: {"allocated": 1.0}, lambda: 0))
    registry.register(ReadsCollector(lambda: [], lambda: {}))
    stats = SimpleNamespace(loads={}, load_failures={}, evictions={}, load_seconds={})
    cache = SimpleNamespace(resident=dict, stats=stats, budget_bytes=1)
    registry.register(ModelsCollector(cache, ["p"]))
    registry.register(UnavailableCollector(("p",), dict))
    counts = dict(existing=0, bound=1, made=0, deleted=0, refused=0, updated=0)
    registry.register(JobConsumersCollector(lambda: SimpleNamespace(**counts)))
    return {family.name for family in registry.collect()}


def test_every_exported_metric_is_named_in_the_docs():
    documented = _documented()
    names = _registered() | _written_in_the_code()
    assert len(names) > 30, "the registry was not filled"
    missing = {
        name
        for name in names
        if not {name, f"{name}_total", f"{name}_info"} & documented and name != PREFIX
    }
    assert missing == set(), "metrics no doc names"
